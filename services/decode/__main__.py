import sys

from services.decode.service import DecodeService
from services.decode.settings import DecodeSettings
from shared.service import run_service

if __name__ == "__main__":
    sys.exit(run_service(DecodeService, DecodeSettings))
