import sys

from kvmesh.main import main

sys.exit(main())
