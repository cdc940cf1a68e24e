"""`python -m jaxpar.sample`: text from a trained checkpoint. The command lives in jaxpar.inference.sample."""

import sys

try:
    from jaxpar.inference.sample import main
except KeyboardInterrupt:  # Ctrl-C while JAX loads: one line and 130, as main's own
    print("jaxpar.sample: interrupted", file=sys.stderr)
    sys.exit(130)

if __name__ == "__main__":
    main()
