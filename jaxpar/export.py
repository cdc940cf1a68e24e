"""`python -m jaxpar.export`: a checkpoint as a Hugging Face directory. The command lives in jaxpar.inference.export."""

from jaxpar.inference.export import main

if __name__ == "__main__":
    main()
