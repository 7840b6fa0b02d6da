import os
import sys

from sglang_like.engine_core.process import main

if __name__ == "__main__":
    code = main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # without waiting for the receiver thread or zmq's context
