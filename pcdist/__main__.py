"""``python -m pcdist [overrides]``: the training service (see pcdist/cli.py)."""

from pcdist.cli import main

if __name__ == "__main__":
    main()
