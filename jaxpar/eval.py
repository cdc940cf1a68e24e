"""`python -m jaxpar.eval`: a checkpoint's loss over the whole val split. The command lives in jaxpar.inference.evaluate."""

import sys

try:
    from jaxpar.inference.evaluate import main
except KeyboardInterrupt:  # Ctrl-C while JAX loads: one line and 130, as main's own
    print("jaxpar.eval: interrupted", file=sys.stderr)
    sys.exit(130)

if __name__ == "__main__":
    main()
