"""A prefix cache as vLLM's counts it, for tests/schedserver.py: prompts hashed in blocks of 16 tokens (a
word is a token there), each block's hash chained to the one before, and a request's hits the leading full
blocks some earlier request already sent (never its last token, which the engine always computes).
Nothing is evicted: the server's counters are what a cache big enough for the test would report."""

BLOCK = 16


def prompt_words(body) -> list[str]:
    """The words the server counts as the prompt's tokens, in order (schedbodies.count_prompt's)."""
    if "messages" in body:
        return [w for m in body["messages"] if isinstance(m, dict) for w in str(m.get("content", "")).split()]
    prompt = body.get("prompt")
    return [str(t) for t in prompt] if isinstance(prompt, list) else str(prompt).split()


class PrefixCache:
    """vllm:prefix_cache_queries_total and vllm:prefix_cache_hits_total, in prompt tokens."""

    def __init__(self):
        self.blocks: set[int] = set()
        self.queries = 0
        self.hits = 0

    def query(self, body) -> int:
        """Count one request; its hit tokens back."""
        words = prompt_words(body)
        self.queries += len(words)
        parent, hit, hitting = 0, 0, True
        for start in range(0, len(words) // BLOCK * BLOCK, BLOCK):  # every full block is cached ...
            parent = hash((parent, tuple(words[start:start + BLOCK])))
            # ... but a hit stops short of the last token, which the engine computes to sample from it.
            if hitting and parent in self.blocks and start + BLOCK < len(words):
                hit += BLOCK
            else:
                hitting = False
                self.blocks.add(parent)
        self.hits += hit
        return hit

    def metrics(self, label: str) -> list[str]:
        return ["# TYPE vllm:prefix_cache_queries counter", f"vllm:prefix_cache_queries_total{label} {float(self.queries)}",
                "# TYPE vllm:prefix_cache_hits counter", f"vllm:prefix_cache_hits_total{label} {float(self.hits)}"]
