"""Write the example images (one scene, a before/after pair, a five-frame story) into examples/.

    python scripts/make_examples.py [FOLDER]
"""

import sys

from mmspec_cli.demo.examples import write_examples

if __name__ == "__main__":
    for path in write_examples(sys.argv[1] if len(sys.argv) > 1 else "examples"):
        print(path)
