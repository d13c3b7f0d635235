"""``python -m pcdist [overrides]``: the training service (see pcdist/service/cli.py)."""

from pcdist.service.cli import main

if __name__ == "__main__":
    main()
