"""The one base class of every error tilegraph reports to a user.

The command line turns a TilegraphError into a one-paragraph message and exit
status 2; anything else escaping is a bug in tilegraph.
"""


class TilegraphError(ValueError):
    pass
