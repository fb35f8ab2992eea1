import sys

from services.encoder.service import EncoderService
from services.encoder.settings import EncoderSettings
from shared.service import run_service

sys.exit(run_service(EncoderService, EncoderSettings))
