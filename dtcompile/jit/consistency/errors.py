"""The errors raised when ranks disagree."""


class RankMismatchError(RuntimeError):
    """Ranks compiled programs that would hang or compute garbage together: different
    collectives, DTensor inputs of different global shapes, or a rank that compiled while
    another ran a cached program."""


class RankFailedError(RankMismatchError):
    """Another rank failed while compiling the program this rank compiled with it; this
    rank raises at once instead of waiting for a program that will not come."""

    def __init__(self, message: str, rank: int, error: str):
        super().__init__(message)
        self.rank = rank  # the rank that failed
        self.error = error  # its error, as ``Type: message``


class GuardsDiffer(Exception):
    """The ranks traced one program with symbolic sizes but assumed different things of
    the sizes (DTensor's arithmetic for one rank's uneven shard): their caches would judge a
    later call differently, one rank running while another compiles. Every rank raises it
    at the same exchange, and compiles the call again with its sizes as they are."""
