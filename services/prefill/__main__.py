import sys

from services.prefill.service import PrefillService
from services.prefill.settings import PrefillSettings
from shared.service import run_service

sys.exit(run_service(PrefillService, PrefillSettings))
