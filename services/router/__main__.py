import sys

from services.router.service import RouterService
from services.router.settings import RouterSettings
from shared.service import run_service

sys.exit(run_service(RouterService, RouterSettings))
