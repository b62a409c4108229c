"""``python -m fledge ...`` is the ``fledge`` command."""

from fledge.cli import main

if __name__ == "__main__":
    main()
