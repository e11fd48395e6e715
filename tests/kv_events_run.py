"""Background run for tests/test_kv_events.py: vLLM's KV-cache events (`kv_events_config`, ZMQ) from a kvserve engine
while requests evict, compact, publish and resume from checkpoints, hit the prefix cache and abort, then enough
plain requests to push every cached block out of the pool. A subscriber thread reads the live stream as vLLM's own
example does (SUB on the publisher's endpoint); at the end the whole stream is replayed from sequence 0 (vLLM's
replay socket), and the JSON file named by argv[1] gets what the events say the prefix cache holds after each
phase next to what vLLM's block pool holds then, and the pool's free blocks.

    python tests/kv_events_run.py OUT.json
"""

from __future__ import annotations

import json
import os
import sys
import threading
import uuid
from collections import Counter

sys.path.insert(0, os.path.dirname(__file__))

from engine_settings import BLOCK_SIZE, engine_kwargs, in_process_env  # noqa: E402

BUDGET, CHECKPOINT = 64, 64
TOPIC = "kvserve-test"


class Subscriber(threading.Thread):
    """The live stream: (sequence number, payload) of every message the publisher sent after we subscribed."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        super().__init__(daemon=True)
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.socket.connect(endpoint)
        self.messages: list[tuple[int, bytes]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.socket.poll(100):
                _, seq, payload = self.socket.recv_multipart()
                self.messages.append((int.from_bytes(seq, "big"), payload))


def replay(endpoint: str) -> list[tuple[int, bytes]]:
    """Every batch the publisher still buffers, from sequence 0 (its replay protocol: DEALER, empty frame, start)."""
    import zmq

    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.connect(endpoint)
    socket.send_multipart((b"", (0).to_bytes(8, "big")))
    batches = []
    while True:
        if not socket.poll(60_000):
            raise RuntimeError("the publisher's replay socket did not answer in 60 s")
        _, topic, seq, payload = socket.recv_multipart()
        if not payload:  # the end marker
            return batches
        batches.append((int.from_bytes(seq, "big"), payload))


def cached_by_events(batches: list[tuple[int, bytes]]) -> tuple[Counter, dict]:
    """How many blocks the events say each hash names now (a hash names several blocks where two requests computed
    the same block: vLLM stores and removes each), and counts of each event kind; a removal beyond what was stored
    is counted (`removed_unknown`)."""
    import msgspec
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    cached: Counter = Counter()
    counts = {"stored": 0, "removed": 0, "removed_unknown": 0, "cleared": 0}
    for _, payload in sorted(batches):
        for event in decoder.decode(payload).events:
            if isinstance(event, BlockStored):
                counts["stored"] += len(event.block_hashes)
                cached.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    counts["removed"] += 1
                    if cached[block_hash]:
                        cached[block_hash] -= 1
                    else:
                        counts["removed_unknown"] += 1
            elif isinstance(event, AllBlocksCleared):
                counts["cleared"] += 1
                cached.clear()
    return +cached, counts


def stored_events(batches: list[tuple[int, bytes]]) -> list:
    import msgspec
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    return [e for _, payload in batches for e in decoder.decode(payload).events if isinstance(e, BlockStored)]


def stored_hashes(batches: list[tuple[int, bytes]]) -> set:
    return {block_hash for event in stored_events(batches) for block_hash in event.block_hashes}


def misnamed_blocks(batches: list[tuple[int, bytes]], sequences: list[list[int]]) -> list[list[int]]:
    """The blocks of BlockStored events whose tokens are not a whole block of any request's tokens."""
    blocks = {tuple(seq[i : i + BLOCK_SIZE]) for seq in sequences for i in range(0, len(seq), BLOCK_SIZE)}
    found = []
    for event in stored_events(batches):
        named = [event.token_ids[i : i + event.block_size] for i in range(0, len(event.token_ids), event.block_size)]
        if len(named) != len(event.block_hashes) or event.block_size != BLOCK_SIZE:
            found.append(event.token_ids)
        found += [block for block in named if tuple(block) not in blocks]
    return found


def unannounced(pool) -> set:
    from kvserve.vllm.points import UNANNOUNCED

    return getattr(pool, UNANNOUNCED, set())


def cached_in_pool(pool, checkpoints: bool) -> Counter:
    """How many blocks vLLM's prefix cache maps each hash to now, the hashes spelt as its events spell them: the
    checkpoints' hashes (kvserve's own, for compacted lists) or the others (vLLM's, for tokens)."""
    from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash

    return Counter(
        {
            maybe_convert_block_hash(get_block_hash(key)): 1 if hasattr(blocks, "block_id") else len(blocks)
            for key, blocks in pool.cached_block_hash_to_block._cache.items()
            if (key in unannounced(pool)) == checkpoints
        }
    )


def main(out: str) -> None:
    in_process_env()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvserve.metrics import metrics
    from kvserve.tools.bench.servers import free_port
    from kvserve.tools.eval.haystack import haystack

    port, replay_port = free_port(), free_port()
    events = {  # vLLM binds a wildcard endpoint and connects to any other
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": TOPIC,
    }
    llm = LLM(**{**engine_kwargs(), "kv_events_config": events})
    subscriber = Subscriber(f"tcp://127.0.0.1:{port}")
    subscriber.start()
    core = llm.llm_engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    tokenizer = llm.get_tokenizer()
    question = tokenizer.encode(" In one sentence, what is this text about? It is about", add_special_tokens=False)
    evicting = {"kv_policy": "snapkv", "kv_budget": BUDGET}
    checkpointed = {**evicting, "kv_checkpoint": CHECKPOINT}
    salt = uuid.uuid4().hex

    sequences = []  # every request's tokens (prompt, then output): what a BlockStored may name

    def generate(prompts: list[list[int]], kv: dict | None, max_tokens: int = 40) -> list:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=kv)
        requests = [TokensPrompt(prompt_token_ids=p, cache_salt=salt) for p in prompts]
        outputs = llm.generate(requests, params, use_tqdm=False)
        sequences.extend(p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs, strict=True))
        return outputs

    def counter(name: str) -> float:
        return getattr(metrics(), name)._value.get()

    plain, document, chat = (haystack(tokenizer, 330, seed=seed) + question for seed in (601, 602, 603))
    # the scheduler publishes a batch per step that has events, in this thread: counting them tells which sequence
    # numbers (the publisher's thread numbers batches from 0 in the order they are handed over) end each phase
    publisher, published = core.scheduler.kv_event_publisher, [0]
    publish = publisher.publish

    def counted(batch) -> None:
        published[0] += 1
        publish(batch)

    publisher.publish = counted
    phases = []

    def phase(name: str) -> None:
        """What the pool's prefix cache holds after this phase, beside how many batches had been published then."""
        tokens, checkpoints = cached_in_pool(pool, checkpoints=False), cached_in_pool(pool, checkpoints=True)
        phases.append({"name": name, "batches": published[0], "pool": tokens, "checkpoints": checkpoints})

    hits = counter("checkpoint_hits")
    generate([plain], {"kv_policy": "full"})
    generate([plain], {"kv_policy": "full"})  # a prefix hit on the plain request's blocks
    phase("plain request and its prefix hit")
    generate([document], evicting)  # publishes its prompt's blocks, then compacts (copies out of them)
    generate([document], evicting)  # hits them, evicts again
    phase("evicting request and its prefix hit")
    (first,) = generate([chat], checkpointed)  # checkpoints: compacted lists under kvserve's own block hashes
    turn = chat + list(first.outputs[0].token_ids) + question
    generate([turn], checkpointed)  # resumes from a checkpoint
    resumed = counter("checkpoint_hits") - hits
    phase("checkpoints published and resumed")
    # an evicting request aborted mid-prefill, and one aborted while decoding
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, extra_args=evicting)
    for name, prompt_tokens, steps in (("aborted-prefill", 1800, 1), ("aborted-decode", 900, 6)):
        prompt = haystack(tokenizer, prompt_tokens, seed=604)
        engine.add_request(name, TokensPrompt(prompt_token_ids=prompt, cache_salt=salt), params)
        output = []
        for _ in range(steps):
            output += [token for done in engine.step() for token in done.outputs[0].token_ids]
        engine.abort_request([name])
        sequences.append(prompt + output)
    while engine.has_unfinished_requests():
        engine.step()
    phase("aborted requests")
    # plain requests on fresh documents until every block has been reused: each earlier cached block is pushed out
    for seed in range(610, 618):
        generate([haystack(tokenizer, 1200, seed=seed)], {"kv_policy": "full"}, max_tokens=8)
    phase("pool cycled by plain requests")
    subscriber.stop.set()
    subscriber.join()
    batches = replay(f"tcp://127.0.0.1:{replay_port}")
    live = dict(subscriber.messages)
    result = {"phases": []}
    for p in phases:
        cached, counts = cached_by_events([(seq, payload) for seq, payload in batches if seq < p["batches"]])
        result["phases"].append(
            {
                "name": p["name"],
                "pool": {repr(h): n for h, n in p["pool"].items()},
                "events": {repr(h): n for h, n in cached.items()},
                "checkpoints": sorted(map(repr, p["checkpoints"])),
                "counts": counts,
            }
        )
    result.update(
        {
            "batches": len(batches),
            "stored_hashes": sorted(map(repr, stored_hashes(batches))),
            "misnamed_blocks": misnamed_blocks(batches, sequences),
            "sequence_numbers": [seq for seq, _ in sorted(batches)],
            "live_matches_replay": all(live[seq] == payload for seq, payload in batches if seq in live),
            "live_batches": len(live),
            "checkpoint_hits": resumed,
            "free_blocks": pool.get_num_free_blocks(),
            "total_blocks": pool.num_gpu_blocks - 1,  # the null block is never free
            "published": published[0],
        }
    )
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
