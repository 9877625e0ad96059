"""`python -m longrange COMMAND ...`: the `longrange` command (see `longrange.commands`)."""

from longrange.commands import main

if __name__ == "__main__":
    raise SystemExit(main())
