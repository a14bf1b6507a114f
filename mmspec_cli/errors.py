"""User-facing errors.

Every problem a user can fix is raised as a :class:`MmspecError` whose message is one
line: what is wrong, then how to fix it. The CLI maps these (and a few library errors,
see ``mmspec_cli.cli.errors``) to exit code 2 without a traceback.
"""


class MmspecError(Exception):
    """A problem with the user's input or environment, with a one-line message."""


class ProfileError(MmspecError):
    """A profile that can't be found, parsed or validated; the message names the key path."""


class InputError(MmspecError):
    """Bad command-line input: images, questions, prompts, numeric ranges."""


class ModelLoadError(MmspecError):
    """A model or processor that can't be loaded or is not supported."""
