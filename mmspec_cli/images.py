"""Reading image files: an alias of :mod:`mmspec_cli.models.images`, kept because the README documents it."""

from mmspec_cli.models.images import load_image, load_images

__all__ = ["load_image", "load_images"]
