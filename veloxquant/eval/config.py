"""What an evaluation measures and how much of it: the protocol's knobs.

Kept free of MLX imports so the command line can build its help from it.
"""

import attrs


@attrs.frozen
class EvalConfig:
    windows: int = 4  # perplexity windows
    prefix: int = 1536  # tokens prefilled before scoring
    score_tokens: int = 256  # continuation tokens scored per window
    prefill_chunk: int = 512  # prefill step (mlx-lm generate's default is 2048)
    score_chunk: int = 32  # continuation fed this many tokens at a time (1 = exact decode)
    fidelity_windows: int = 1
    passkey_lengths: tuple = (1024, 2048)
    passkey_depths: tuple = (0.1, 0.5, 0.9)
    passkey_trials: int = 1
    passkey_max_tokens: int = 8
    seed: int = 0

    @property
    def window_len(self) -> int:
        return self.prefix + self.score_tokens + 1
