"""`python -m erpo.integrations.verl ref-cache OVERRIDES... [--overwrite]`: the reference cache
of a verl run, from the overrides it trains with (erpo.integrations.verl.cache_command)."""
import sys

from ._command import REF_CACHE_COMMAND


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(f"usage: {REF_CACHE_COMMAND} OVERRIDES... [--overwrite] (details: {REF_CACHE_COMMAND} --help)")
        return 0
    if not argv or argv[0] != "ref-cache":
        print(f"erpo: error: usage: {REF_CACHE_COMMAND} OVERRIDES... [--overwrite] (the one command is ref-cache; "
              f"{REF_CACHE_COMMAND} --help)", file=sys.stderr)
        return 2
    from .cache_command import main as ref_cache

    return ref_cache(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
