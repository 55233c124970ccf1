"""``featcache.lmdeploy.media``, the documented import path of the media policy (docs/lmdeploy.md,
docs/cli.md: ``MediaPolicy``, ``MAX_IMAGE_OPTIONS_BYTES``): its home is
``featcache.lmdeploy.request.media``; its public names, re-exported."""

from .request.media import *  # noqa: F403
