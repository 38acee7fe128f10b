"""A tiny, slow `specdecode serve` for the SIGTERM test (tests/test_server_ops.py).

    PYTHONPATH=src:tests python tests/slow_server.py PORT GRACEFUL_TIMEOUT_S

The same tiny float32 models as tests/test_server.py, each step slowed down and EOS ignored so
that a long generation surely outlasts the graceful timeout; served by `specdecode.server.run.serve`,
the function `specdecode serve` calls, in this process's main thread (where signals arrive).
"""

from __future__ import annotations

import sys
import time

from specdecode import SpeculativeDecoder
from specdecode.models.loading import wrap_model
from specdecode.server.app import create_app
from specdecode.server.run import serve

from conftest import char_tokenizer, noisy_copy, tiny_llama

STEP_DELAY_S = 0.1  # k = 3: at most 4 tokens a step, so 200 tokens take 5 s or more


class SlowEngine(SpeculativeDecoder):
    # the worker steps a batch session: each step waits first
    def batch_session(self, *args, **kwargs):
        session = super().batch_session(*args, **kwargs)
        step = session.step

        def slowly():
            time.sleep(STEP_DELAY_S)
            return step()

        session.step = slowly
        return session


def main(port: int, graceful_timeout_s: float) -> int:
    tokenizer = char_tokenizer(":")
    target = tiny_llama(seed=0, vocab=len(tokenizer))
    engine = SlowEngine(wrap_model(target, tokenizer, name="tiny"), noisy_copy(target, 0.05), k=3)
    engine.eos_token_ids = set()
    app = create_app(engine, "tiny", queue_size=4, max_batch=1)  # one running, one queued
    serve(app, "127.0.0.1", port, graceful_timeout_s=graceful_timeout_s, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), float(sys.argv[2])))
