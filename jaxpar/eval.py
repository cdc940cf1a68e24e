"""`python -m jaxpar.eval`: a checkpoint's loss over the whole val split. The command lives in jaxpar.inference.evaluate."""

from jaxpar.inference.evaluate import main

if __name__ == "__main__":
    main()
