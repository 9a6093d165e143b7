#!/usr/bin/env python3
"""Language-neutral checks of the rlstream message schemas, from Python.

  check.py fixtures                          validate schemas/fixtures/* against schemas/*.schema.json
  check.py write-rollout --redis URL --stream KEY
                                             build a RolloutGroup in Python and XADD it (field "d")
  check.py read-rollout --redis URL --stream KEY --id ID
                                             read a RolloutGroup written by rlstream, validate, print JSON

Only the schema files are used: this is how a verifier or dashboard in another language
joins the pipeline. Mapping between MessagePack and the JSON view: bin <-> base64 string.
"""
import argparse
import array
import base64
import json
import pathlib
import struct
import sys

import jsonschema
import msgpack
import redis
from referencing import Registry, Resource

HERE = pathlib.Path(__file__).resolve().parent
PAYLOAD_FIELD = b"d"


def load_registry():
    schemas = {}
    for path in sorted(HERE.glob("*.schema.json")):
        schema = json.loads(path.read_text())
        schemas[schema["title"]] = schema
    registry = Registry().with_resources(
        (s["$id"], Resource.from_contents(s)) for s in schemas.values()
    )
    return schemas, registry


def to_json_view(value):
    """The documented MessagePack -> JSON mapping: bin becomes base64."""
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, dict):
        return {k: to_json_view(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_view(v) for v in value]
    return value


def validate(name, view, schemas, registry):
    validator = jsonschema.Draft202012Validator(schemas[name], registry=registry)
    errors = sorted(validator.iter_errors(view), key=lambda e: list(e.path))
    if errors:
        raise SystemExit(f"{name}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors))


def unpack(b, code):
    """A little-endian bin as a list: code "I" for u32, "f" for f32."""
    a = array.array(code)
    a.frombytes(b)
    if sys.byteorder != "little":
        a.byteswap()
    return list(a)


def pack(values, code):
    """A list as a little-endian bin: code "I" for u32, "f" for f32."""
    a = array.array(code, values)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def u32s(b):
    return unpack(b, "I")


def f32s(b):
    return unpack(b, "f")


def pack_u32(values):
    return pack(values, "I")


def pack_f32(values):
    return pack(values, "f")


def varints(b):
    """Unsigned LEB128 varints of a bin, in order."""
    out, v, shift = [], 0, 0
    for byte in b:
        v |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            out.append(v)
            v, shift = 0, 0
    if shift:
        raise SystemExit("packed kept sets: cut short inside a varint")
    return out


def kept_sets(mask):
    """A sampling mask's kept set per step, from either wire form: packed kept sets (a bin,
    schema 3.0: per step the size, then the first id and each later id's gap to the one
    before minus one) or CSR (a map {offsets, ids}, before 3.0)."""
    if isinstance(mask, dict):
        offsets, ids = u32s(mask["offsets"]), u32s(mask["ids"])
        return [ids[a:b] for a, b in zip(offsets, offsets[1:])]
    values, sets, at = varints(mask), [], 0
    while at < len(values):
        n, at = values[at], at + 1
        if at + n > len(values):
            raise SystemExit(f"packed kept sets: step {len(sets)} announces {n} ids, {len(values) - at} left")
        ids = []
        for gap in values[at:at + n]:
            ids.append(gap if not ids else ids[-1] + gap + 1)
        sets.append(ids)
        at += n
    return sets


def check_mask(i, s, tokens, env, schema):
    mask = s.get("mask")
    if mask is None:
        return
    if not isinstance(mask, dict) and schema[0] < 3:
        raise SystemExit(f"samples[{i}]: packed kept sets need schema major 3")
    sets = kept_sets(mask)
    if len(sets) != len(tokens):
        raise SystemExit(f"samples[{i}]: {len(sets)} kept sets for {len(tokens)} tokens")
    for t, (tok, kept) in enumerate(zip(tokens, sets)):
        if t not in env and tok not in kept:
            raise SystemExit(f"samples[{i}]: sampled token {tok} at {t} is not in its kept set")


def check_rollout_semantics(msg):
    episodes = False
    for i, s in enumerate(msg["samples"]):
        tokens, logprobs = u32s(s["tokens"]), f32s(s["logprobs"])
        if len(tokens) != len(logprobs):
            raise SystemExit(f"samples[{i}]: {len(tokens)} tokens but {len(logprobs)} logprobs")
        if s["versions"][0][0] != 0:
            raise SystemExit(f"samples[{i}]: first version run does not start at 0")
        end = 0
        for start, n in s.get("env", []):
            if n < 1 or start < end or start + n > len(tokens):
                raise SystemExit(f"samples[{i}]: env span [{start}, {n}] overlaps, is empty or runs past the tokens")
            end = start + n
            episodes = True
        env = {t for start, n in s.get("env", []) for t in range(start, start + n)}
        last = -1
        for index, reward in s.get("turn_rewards", []):
            if index <= last or index >= len(tokens) or index in env or reward != reward:
                raise SystemExit(f"samples[{i}]: turn reward at {index} is out of order, past the tokens, on an env token or NaN")
            last = index
        check_mask(i, s, tokens, env, msg["schema"])
    check_routing(msg)
    # A 1.x trainer would train the environment's tokens: an episode is 2.x.
    if episodes and msg["schema"][0] < 2:
        raise SystemExit("a rollout with env spans needs schema major 2")
    return episodes


def routing_ids(r, tokens, field):
    """The ids of a Routing covering `tokens` tokens, checked."""
    layers, k, experts = r["layers"], r["k"], r["experts"]
    width = 1 if experts <= 256 else 2
    raw = r["ids"]
    if len(raw) != tokens * layers * k * width:
        raise SystemExit(f"{field}: {len(raw)} bytes for {tokens} tokens x {layers} layers x {k} ids x {width}")
    ids = list(raw) if width == 1 else list(struct.unpack(f"<{len(raw) // 2}H", raw))
    for c in range(0, len(ids), k):
        chosen = ids[c:c + k]
        if max(chosen) >= experts or len(set(chosen)) != k:
            raise SystemExit(f"{field}: ids {chosen} out of range or repeated")
    return ids


def check_routing(msg):
    """prompt_routing covers the prompt, each sample's routing its tokens but the last."""
    prompt = msg.get("prompt_routing")
    routed = [s.get("routing") is not None for s in msg["samples"]]
    if prompt is None:
        if any(routed):
            raise SystemExit("a sample has routing but the group has no prompt_routing")
        return
    if not all(routed):
        raise SystemExit("prompt_routing without every sample's routing")
    routing_ids(prompt, len(u32s(msg["prompt_tokens"])), "prompt_routing")
    shape = (prompt["layers"], prompt["k"], prompt["experts"])
    for i, s in enumerate(msg["samples"]):
        r = s["routing"]
        if (r["layers"], r["k"], r["experts"]) != shape:
            raise SystemExit(f"samples[{i}].routing: shape differs from prompt_routing's")
        routing_ids(r, max(len(u32s(s["tokens"])) - 1, 0), f"samples[{i}].routing")
    if tuple(msg["schema"]) < (2, 2):
        raise SystemExit("a rollout with routing needs schema 2.2")


def check_scored_semantics(msg):
    samples = msg["rollout"]["samples"]
    for field in ("token_rewards", "ref_logprobs"):
        arrays = msg.get(field)
        if arrays is None:
            continue
        if len(arrays) != len(samples):
            raise SystemExit(f"{field}: {len(arrays)} arrays for {len(samples)} samples")
        for i, (a, s) in enumerate(zip(arrays, samples)):
            n, want = len(f32s(a)), len(u32s(s["tokens"]))
            if n != want:
                raise SystemExit(f"{field}[{i}]: {n} values for {want} tokens")
    # A 1.x trainer would train without token rewards: a group that carries them is 2.x.
    if any(any(f32s(a)) for a in msg.get("token_rewards") or []) and msg["schema"][0] < 2:
        raise SystemExit("token_rewards with non-zero rewards need schema major 2")


def cmd_fixtures(_args):
    schemas, registry = load_registry()
    checked = 0
    missing = [n for n in schemas if not (HERE / "fixtures" / f"{n}.msgpack").exists()]
    if missing:
        raise SystemExit(f"no fixture for {', '.join(missing)}")
    # NAME.msgpack is what this build writes; NAME.vK.msgpack an older version it reads.
    for path in sorted((HERE / "fixtures").glob("*.msgpack")):
        name = path.name.split(".")[0]
        if name not in schemas:
            raise SystemExit(f"{path.name}: no schema {name}.schema.json")
        raw = path.read_bytes()
        msg = msgpack.unpackb(raw, raw=False)
        view = to_json_view(msg)
        validate(name, view, schemas, registry)
        twin = json.loads(path.with_suffix(".json").read_text())
        if view != twin:
            raise SystemExit(f"{name}: fixture and its .json twin disagree")
        if name == "RolloutGroup":
            check_rollout_semantics(msg)
        elif name == "ScoredGroup":
            if check_rollout_semantics(msg["rollout"]) and msg["schema"][0] < 3:
                raise SystemExit("a scored episode needs schema major 3")
            check_scored_semantics(msg)
            packed = any(isinstance(s.get("mask"), bytes) for s in msg["rollout"]["samples"])
            if packed and msg["schema"][0] < 4:
                raise SystemExit("a scored group with packed kept sets needs schema major 4")
        checked += 1
        print(f"ok  {path.name}: {len(raw)} bytes, valid against {name}.schema.json, .json twin matches")
    print(f"{checked} passed, 0 failed")


def python_rollout():
    tokens = [5, 6, 7, 0]
    return {
        "schema": [1, 0],
        "group_id": "py-verifier-0001",
        "prompt_id": "add-000001",
        "task": "add",
        "prompt_tokens": pack_u32([2, 3, 11, 4, 1, 12]),
        "samples": [
            {
                "tokens": pack_u32(tokens),
                "logprobs": pack_f32([-0.5, -0.25, -1.0, -0.125]),
                "versions": [[0, 3], [2, 4]],
                "finish": "stop",
                "mask": {"offsets": pack_u32([0, 2, 4, 6, 8]), "ids": pack_u32([5, 1, 6, 2, 7, 3, 0, 4])},
            },
            {
                # The list form, as a hand-written producer might send it.
                "tokens": [9, 9],
                "logprobs": [-2.0, -3.0],
                "versions": [[0, 4]],
                "finish": "length",
            },
        ],
        "sampling": {"temperature": 0.7, "top_k": 2, "top_p": 1.0, "max_new_tokens": 4, "stop_tokens": [0], "seed": 99},
        "gen_id": "python",
        "started_us": 1767225600000000,
        "finished_us": 1767225600100000,
        "meta": {"answer": "42"},
        "written_by": "python",  # an unknown field: readers must ignore it
    }


def cmd_write_rollout(args):
    schemas, registry = load_registry()
    msg = python_rollout()
    validate("RolloutGroup", to_json_view(msg), schemas, registry)
    r = redis.Redis.from_url(args.redis)
    entry_id = r.xadd(args.stream, {PAYLOAD_FIELD: msgpack.packb(msg, use_bin_type=True)})
    print(entry_id.decode())


def cmd_read_rollout(args):
    schemas, registry = load_registry()
    r = redis.Redis.from_url(args.redis)
    entries = r.xrange(args.stream, args.id, args.id)
    if not entries:
        raise SystemExit(f"no entry {args.id} in {args.stream}")
    msg = msgpack.unpackb(entries[0][1][PAYLOAD_FIELD], raw=False)
    validate("RolloutGroup", to_json_view(msg), schemas, registry)
    check_rollout_semantics(msg)
    summary = {
        "group_id": msg["group_id"],
        "tokens": [u32s(s["tokens"]) for s in msg["samples"]],
        "logprobs": [f32s(s["logprobs"]) for s in msg["samples"]],
        "versions": [s["versions"] for s in msg["samples"]],
    }
    print(json.dumps(summary))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("fixtures")
    for name in ("write-rollout", "read-rollout"):
        sp = sub.add_parser(name)
        sp.add_argument("--redis", default="redis://127.0.0.1:6379")
        sp.add_argument("--stream", required=True)
        if name == "read-rollout":
            sp.add_argument("--id", required=True)
    args = p.parse_args()
    {"fixtures": cmd_fixtures, "write-rollout": cmd_write_rollout, "read-rollout": cmd_read_rollout}[args.cmd](args)


if __name__ == "__main__":
    main()
