"""User-facing errors: one line, exit status 2, no traceback (see `train.main`)."""


class UserError(Exception):
    """A mistake in the user's input (config, data file, command line).

    The message is printed as one line to stderr; it must name the key, file or file:line.
    """


class ConfigError(UserError):
    """A bad config key, type or value. The message starts with the dotted key."""


class TrainingFault(Exception):
    """Training cannot go on (e.g. too many steps in a row with non-finite values).

    Printed as one line to stderr, exit status 3; the message names the likely cause and the
    checkpoint left behind.
    """
