"""`python -m jaxpar.prepare`: text files to train.bin, val.bin and meta.json. The command lives in jaxpar.data.prepare."""

from jaxpar.data.prepare import main

if __name__ == "__main__":
    main()
