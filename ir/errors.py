"""The one base class of every error tilegraph reports to a user.

The command line turns a TilegraphError into a one-paragraph message and exit
status 2; anything else escaping is a bug in tilegraph. It is no ValueError, so a
handler of NumPy's or Python's ValueError never swallows a user's error, and a
handler of TilegraphError never swallows a bug.
"""


class TilegraphError(Exception):
    pass
