"""``python -m meshsim``: the same command as the ``meshsim`` console script."""

from meshsim.cli.main import console

if __name__ == "__main__":  # not when a spawned sweep worker imports this module
    console()
