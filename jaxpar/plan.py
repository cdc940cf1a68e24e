"""`python -m jaxpar.plan`: every layout of a target compiled, checked and ranked. The command lives in jaxpar.planning.plan."""

from jaxpar.planning.plan import main

if __name__ == "__main__":
    main()
