import sys

from services.cachemeta.service import CachemetaService
from services.cachemeta.settings import CachemetaSettings
from shared.service import run_service

sys.exit(run_service(CachemetaService, CachemetaSettings))
