"""`python -m jaxpar.plot`: loss curves of run directories. The command lives in jaxpar.training.plots."""

from jaxpar.training.plots import main

if __name__ == "__main__":
    main()
