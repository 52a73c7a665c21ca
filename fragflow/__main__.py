"""``python -m fragflow ...``: the ``fragflow`` command (for an environment whose scripts are not on PATH)."""

from fragflow.cli import main

if __name__ == "__main__":
    main()
