"""Ranks that disagree: every rank fails fast with a clear error, none waits.

Ranks that run different collectives hang at the first one that differs; DTensors of
different global shapes make Gloo abort. So after each compilation the ranks of the
program's meshes and collectives exchange, through the default store (never a
collective), what must agree for the program to run together: the DTensor inputs' global
metadata and the sequence of collectives (``agreement.py``). The exchange's key names the
compiled code, not the order of ``jit`` calls (``identity.py``). A rank that fails while
compiling posts its failure under that key, and the ranks waiting there raise at once
(``exchange.py``). A rank whose cached program fails in a collective while a peer compiled
instead says so (``stall.py``); with ``DTCOMPILE_RANK_CHECK=calls`` the ranks also agree
at every call, before any collective runs (``calls.py``). Ranks whose symbolic traces
assumed different things of the sizes compile the call again with its sizes as they are
(``GuardsDiffer``).
"""

from .agreement import RankAgreement
from .calls import calls_checked, check_hit, post_miss
from .errors import GuardsDiffer, RankFailedError, RankMismatchError
from .identity import code_identity
from .program import group_labels
from .stall import explain_stall

__all__ = [
    "GuardsDiffer",
    "RankAgreement",
    "RankFailedError",
    "RankMismatchError",
    "calls_checked",
    "check_hit",
    "code_identity",
    "explain_stall",
    "group_labels",
    "post_miss",
]
