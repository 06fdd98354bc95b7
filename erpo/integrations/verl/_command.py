"""The name of `python -m erpo.integrations.verl ref-cache`, and what it says where verl is
not installed (imported by the package before verl is, so it needs nothing)."""
import sys

REF_CACHE_COMMAND = "python -m erpo.integrations.verl ref-cache"


def without_verl(argv, why: str = "") -> int:
    """The command where verl cannot be imported (`why`: the ImportError's text): --help is
    its usage and a note, anything else one line, `erpo: error: ...`, and exit status 2."""
    missing = (f"verl cannot be imported here ({why})" if why else "verl is not installed here") + \
        ": docs/verl.md says how to install it beside erpo"
    if any(a in ("-h", "--help") for a in argv):
        print(f"usage: {REF_CACHE_COMMAND} OVERRIDES... [--overwrite]\n"
              f"Builds the reference cache of a verl run from the overrides it trains with (docs/verl.md).\n"
              f"Note: {missing}.")
        return 0
    print(f"erpo: error: {REF_CACHE_COMMAND} needs verl; {missing}", file=sys.stderr)
    return 2
