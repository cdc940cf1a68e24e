"""`python -m jaxpar.plot`: loss curves of run directories. The command lives in jaxpar.training.run.loss_plots."""

from jaxpar.training.run.loss_plots import main

if __name__ == "__main__":
    main()
