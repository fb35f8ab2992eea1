import sys

from services.prefill.service import PrefillService
from services.prefill.settings import PrefillSettings
from shared.service import run_service

if __name__ == "__main__":
    sys.exit(run_service(PrefillService, PrefillSettings))
