"""`python -m jaxpar.bench`: one config on several layouts, compared. The command lives in jaxpar.planning.bench."""

from jaxpar.planning.bench import main

if __name__ == "__main__":
    main()
