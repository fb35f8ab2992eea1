"""Images in a chat request: read, checked and counted in tokens before anything else happens.

Each image is refused here (400 naming its part and the limit): in a message that is not the
user's, not a data: URL (or http(s) when allowed), not PNG/JPEG/WebP, too many bytes, too many
pixels declared (a decompression bomb is refused from its header), too many images. Its tokens
come from its header (``VisionGrid``); its identity is its content's hash, salted with the
tenant's salt. The encodes are dispatch's (``dispatch/encodes.py``).
"""

from __future__ import annotations

from aiohttp.abc import AbstractResolver

from services.router.dispatch.encodes import ImageInput
from services.router.errors import ApiError
from services.router.request.conversation import Conversation
from services.router.request.remote import Reach, fetch_image
from services.router.settings import ImageSettings
from shared.settings import CommonSettings
from shared.vision.images import BadImage, content_hash, decode_data_url, probe

FRAMING_BYTES = 4096  # room in a NATS message for the request beside the image


class ImageReader:
    def __init__(
        self,
        settings: ImageSettings,
        common: CommonSettings,
        names: AbstractResolver | None = None,  # how URLs' hosts resolve (else the system's)
    ) -> None:
        self.settings = settings
        self.names = names
        self.grid = common.vision_grid  # how an image's size becomes tokens (as the encoder's)
        self.max_pixels = common.image_max_pixels
        hosts = frozenset(h.rstrip(".").lower() for h in settings.remote_image_hosts)
        self.reach = Reach(settings.remote_images_private, hosts)

    async def read_all(self, conv: Conversation, salt: str, max_payload: int) -> list[ImageInput]:
        """The conversation's images, each checked, in order. ``max_payload``: the bus's
        message size (an image travels to the encoder in one message)."""
        found = conv.images()
        most = self.settings.images_per_request
        if len(found) > most:
            why = f"messages: at most {most} images per request (got {len(found)})"
            raise ApiError(400, why, param="messages")
        images = []
        for role, image in found:
            if role != "user":
                why = f"{image.param}: images are accepted in user messages only"
                raise ApiError(400, why, param=image.param)
            images.append(await self.read(image.url, image.param, max_payload, salt))
        return images

    async def read(self, url: str, param: str, max_payload: int, salt: str = "") -> ImageInput:
        """An image part's bytes, checked; ApiError(400) naming ``param`` and the limit."""
        s = self.settings
        max_bytes = min(s.image_max_bytes, max_payload - FRAMING_BYTES)
        try:
            if url.startswith(("http://", "https://")):
                if not s.allow_remote_images:
                    raise BadImage(
                        "only data: URLs are accepted (this server fetches nothing; "
                        "KVMESH_ROUTER_ALLOW_REMOTE_IMAGES=true allows http(s) URLs)"
                    )
                data = await fetch_image(
                    url, max_bytes, s.remote_image_timeout_s, self.reach, self.names
                )
            else:
                data = decode_data_url(url, max_bytes)
            info = probe(data, self.max_pixels)
        except BadImage as err:
            raise ApiError(400, f"{param}: {err}", param=param, code="invalid_image") from None
        tokens = self.grid.tokens(info.width, info.height)
        return ImageInput(param, data, content_hash(data, salt), tokens, salt)
