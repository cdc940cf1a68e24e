"""`python -m jaxpar.sample`: text from a trained checkpoint. The command lives in jaxpar.inference.sample."""

from jaxpar.inference.sample import main

if __name__ == "__main__":
    main()
