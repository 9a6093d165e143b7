#!/usr/bin/env python3
"""Generates src/model/counted/delegate/ (one file per group of traits, each under the
line limit, and their mod.rs): every method of burn's backend traits
(`Backend` and the `*Ops` traits, provided methods included) delegated from
`Counted<B>` to `B`, with the host-data crossings counted and every operation over zero
elements refused (`counted::nonempty`: a kernel launch with no blocks, which CUDA refuses).

Delegating the provided methods too matters: a default such as `float_zeros` builds host
data and uploads it, where a device backend overrides it with a fill on the device; the
wrapper must take the inner backend's path, not the default's, or it would count (and
cause) transfers the backend does not make.

Run after changing burn's version:
    python3 scripts/gen_counted.py "$(cargo metadata --format-version 1 | python3 -c \
        'import json,sys; print(next(p["manifest_path"] for p in json.load(sys.stdin)["packages"] if p["name"]=="burn-backend").rsplit("/",1)[0])')" \
        src/model/counted/delegate && cargo fmt
"""
import re
import sys
from pathlib import Path

TRAITS = [
    ("backend/ops/tensor.rs", "FloatTensorOps"),
    ("backend/ops/int_tensor.rs", "IntTensorOps"),
    ("backend/ops/bool_tensor.rs", "BoolTensorOps"),
    ("backend/ops/qtensor.rs", "QTensorOps"),
    ("backend/ops/modules/base.rs", "ModuleOps"),
    ("backend/ops/activation.rs", "ActivationOps"),
    ("backend/ops/transaction.rs", "TransactionOps"),
    ("backend/base.rs", "Backend"),
]

# Methods whose result or argument is host data: (kind, direction).
WRITES = {"float_from_data", "int_from_data", "bool_from_data", "q_from_data"}
READS = {"float_into_data", "int_into_data", "bool_into_data", "q_into_data"}
SKIP = {"tr_execute"}
# Tensor types whose element count is checked, as arguments and results.
TENSOR = r"(FloatTensor|IntTensor|BoolTensor|QuantizedTensor|TensorPrimitive)<B>"
# Operations that launch no kernel even over zero elements, so they are not refused:
# allocation without a fill, the host transfers, device moves and autodiff markers.
NO_LAUNCH = re.compile(r"_(empty|from_data|into_data|device|to_device|detach|require_grad)$")
# Results that are structs generic over the backend: rebuilt for `Counted<B>` field by field.
STRUCTS = {
    "DeformConv2dBackward": ["x_grad", "offset_grad", "weight_grad", "mask_grad", "bias_grad"],
    "MaxPool1dBackward": ["x_grad"],
    "MaxPool2dBackward": ["x_grad"],
    "MaxPool1dWithIndices": ["output", "indices"],
    "MaxPool2dWithIndices": ["output", "indices"],
}


def trait_body(src: str, name: str) -> str:
    m = re.search(r"\npub trait " + name + r"\b", src)
    if not m:
        raise SystemExit(f"trait {name} not found")
    i = src.index("{", m.end())
    # The supertrait list of `Backend` has no braces; the body starts at the first one.
    depth, j = 0, i
    while True:
        c = src[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return src[i + 1 : j]
        j += 1


def strip_comments(s: str) -> str:
    s = re.sub(r"//[^\n]*", "", s)
    return re.sub(r"/\*.*?\*/", "", s, flags=re.S)


def methods(body: str):
    """(attributes, signature) of each fn at the body's top level."""
    out, i, depth, attrs = [], 0, 0, []
    while i < len(body):
        c = body[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif depth == 0 and body.startswith("#[", i):
            j, d = i + 1, 0
            while True:
                if body[j] == "[":
                    d += 1
                elif body[j] == "]":
                    d -= 1
                    if d == 0:
                        break
                j += 1
            attrs.append(body[i : j + 1])
            i = j
        elif depth == 0 and re.match(r"fn\s", body[i:]) and (i == 0 or not body[i - 1].isalnum()):
            j, paren = i, 0
            while True:
                ch = body[j]
                if ch == "(":
                    paren += 1
                elif ch == ")":
                    paren -= 1
                elif paren == 0 and ch in "{;":
                    break
                j += 1
            sig = " ".join(body[i:j].split())
            out.append(([a for a in attrs if a.startswith("#[cfg")], sig))
            attrs = []
            i = j
            continue
        elif depth == 0 and body.startswith("type ", i):
            j = body.index(";", i)
            i = j
            attrs = []
        i += 1
    return out


def split_top(s: str, sep=","):
    parts, depth, cur = [], 0, ""
    for c in s:
        if c in "<([":
            depth += 1
        elif c in ">)]":
            depth -= 1
        if c == sep and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += c
    if cur.strip():
        parts.append(cur)
    return [p.strip() for p in parts]


def parse(sig: str):
    """Name, generics, argument names and type parameters of a signature."""
    m = re.match(r"fn (\w+)\s*", sig)
    if not m:
        raise SystemExit(f"cannot parse: {sig}")
    name, k = m.group(1), m.end()
    generics = ""
    if sig[k] == "<":
        depth = 0
        for k2 in range(k, len(sig)):
            if sig[k2] == "<":
                depth += 1
            elif sig[k2] == ">" and sig[k2 - 1] != "-":
                depth -= 1
                if depth == 0:
                    break
        generics, k = sig[k : k2 + 1], k2 + 1
        while sig[k] == " ":
            k += 1
    paren = 0
    for end in range(k, len(sig)):
        if sig[end] == "(":
            paren += 1
        elif sig[end] == ")":
            paren -= 1
            if paren == 0:
                break
    params = sig[k + 1 : end]
    args, types = [], []
    for p in split_top(params):
        pat, ty = (x.strip() for x in p.split(":", 1))
        if pat in ("&self", "self", "&mut self"):
            raise SystemExit(f"method with self: {sig}")
        pat = pat.replace("mut ", "").strip()
        types.append((pat, ty))
        # Structs generic over the backend are other types for `B`: rebuilt field by field.
        if ty.startswith("TensorPrimitive<"):
            pat = f"counted::inner_primitive({pat})"
        elif ty.startswith("QuantizationParametersPrimitive<"):
            pat = f"counted::inner_qparams({pat})"
        elif "Primitive<" in ty:
            raise SystemExit(f"argument type to convert: {sig}")
        args.append(pat)
    type_params = []
    if generics:
        for g in split_top(generics[1:-1]):
            g = g.strip()
            if not g.startswith("'"):
                type_params.append(re.split(r"[:\s]", g)[0])
    return name, generics, args, type_params, types


def checks(name: str, types, ret: str):
    """The zero-element checks of a method: its tensor arguments' (before the call) and its
    tensor results' (after), as `(before, after)` lines, empty for an operation that launches
    nothing. The first check also counts the operation (`counted::operations`): a check of
    one argument is `counted::takes`, of several `counted::operands`, of a single result
    made from no tensor `counted::makes`; `after` is `["made"]` or `["makes"]` for one tensor
    result (the call goes through that function)."""
    if NO_LAUNCH.search(name):
        return [], []
    op = f'"{name}"'
    before, single = [], [pat for pat, ty in types if re.fullmatch(TENSOR, ty)]
    if len(single) == 1:
        before.append(f"counted::takes({op}, &{single[0]});")
    elif single:
        before.append(f"counted::operands({op}, ({', '.join('&' + a for a in single)}));")
    for pat, ty in types:
        if re.fullmatch(r"Vec<" + TENSOR + r">", ty):
            if not before:
                before.append(f"counted::count({op});")
            before.append(f"{pat}.iter().for_each(|t| counted::nonempty({op}, t));")
    ret = ret.strip().removeprefix("->").strip()
    after = []
    if re.fullmatch(TENSOR, ret):
        after.append("made" if before else "makes")
    elif re.fullmatch(r"Vec<" + TENSOR + r">", ret):
        after.append(f"out.iter().for_each(|t| counted::nonempty({op}, t));")
    elif ret.startswith("(") and all(re.fullmatch(TENSOR, t) for t in split_top(ret[1:-1])):
        after += [f"counted::nonempty({op}, &out.{i});" for i in range(len(split_top(ret[1:-1])))]
    if after and not before and after[0] not in ("made", "makes"):
        before.append(f"counted::count({op});")
    return before, after


def self_types(s: str) -> str:
    return re.sub(r"\bB\b", "Self", s)


def emit(trait: str, attrs, sig: str) -> str:
    name, _generics, args, type_params, types = parse(sig)
    assert name not in SKIP
    target = "B"
    call_args = ", ".join(a for a in args)
    turbofish = f"::<{', '.join(type_params)}>" if type_params else ""
    call = f"<{target} as {trait}{'' if trait == 'Backend' else '<B>'}>::{name}{turbofish}({call_args})"
    # In the `Backend` impl `Self::Device` is ambiguous (two traits name it): `B`'s is the same.
    sig_out = self_types(sig) if trait != "Backend" else sig.replace("Self::Device", "B::Device")
    sig_out = sig_out.replace("crate::", "burn_backend::")
    # Parameters named `_x` are passed on, so they lose the underscore's meaning.
    ret = sig.rsplit(")", 1)[1]
    if "TensorPrimitive<B>" in ret:
        if ret.strip() != "-> TensorPrimitive<B>":
            raise SystemExit(f"return type to convert: {sig}")
        call = f"counted::primitive({call})"
    m = re.match(r"\s*->\s*(\w+)<B>\s*$", ret)
    if m and m.group(1) in STRUCTS:
        fields = ", ".join(f"{f}: r.{f}" for f in STRUCTS[m.group(1)])
        call = f"let r = {call};\n        {m.group(1)} {{ {fields} }}"
    if name in WRITES:
        first = args[0]
        body = f"counted::wrote(&{first});\n        {call}"
    elif name in READS:
        body = f"let read = {call};\n        async move {{\n            let data = read.await;\n            if let Ok(d) = &data {{\n                counted::read(d);\n            }}\n            data\n        }}"
    else:
        body = call
    before, after = checks(name, types, ret)
    if after in (["made"], ["makes"]):
        body = f"counted::{after[0]}(\"{name}\", {body})"
    elif after:
        body = f"let out = {body};\n        " + "\n        ".join(after) + "\n        out"
    if before:
        body = "\n        ".join(before) + "\n        " + body
    lines = [f"    {a}" for a in attrs]
    lines.append(f"    {sig_out} {{\n        {body}\n    }}")
    return "\n".join(lines)


# The files of the delegate module and the traits each holds.
FILES = {
    "float": ["FloatTensorOps"],
    "int": ["IntTensorOps"],
    "bool": ["BoolTensorOps"],
    "quant": ["QTensorOps"],
    "module": ["ModuleOps"],
    "backend": ["ActivationOps", "TransactionOps", "Backend"],
}

HEADER = [
    "//! Generated by `scripts/gen_counted.py` from burn-backend's traits: do not edit.",
    "//! Every method, provided ones included, delegates to the inner backend.",
    "#![allow(clippy::all, clippy::pedantic, unused_variables, unused_imports)]",
    "",
    "use crate::model::counted::{self, Counted};",
    "use burn_backend::ops::*;",
    "use burn_backend::tensor::*;",
    "use burn_backend::*;",
    "use burn_backend::tensor::Device;",
    "use burn_backend::tensor::quantization::QuantizationParametersPrimitive;",
    "use burn_std::quantization::{QuantPropagation, QuantScheme};",
    "use burn_std::{BoolDType, DType, FloatDType, IntDType, Shape, Slice};",
    "use core::future::Future;",
    "use core::ops::Range;",
    "",
]


def impl_of(root: Path, path: str, trait: str) -> list:
    src = strip_comments((root / path).read_text())
    fns = methods(trait_body(src, trait))
    if trait == "Backend":
        out = ["impl<B: Backend> Backend for Counted<B> {"]
    else:
        out = [f"impl<B: Backend> {trait}<Self> for Counted<B> {{"]
    for attrs, sig in fns:
        # A transaction holds the backend's primitives in a struct with private fields,
        # which cannot be rebuilt for the inner backend: the provided method reads each
        # tensor through `*_into_data` here, counted there.
        if re.match(r"fn (\w+)", sig).group(1) in SKIP:
            continue
        out.append(emit(trait, attrs, sig))
    out.append("}\n")
    return out


def main():
    root = Path(sys.argv[1]) / "src"
    dest = Path(sys.argv[2])
    dest.mkdir(parents=True, exist_ok=True)
    paths = dict((t, p) for p, t in TRAITS)
    for name, traits in FILES.items():
        out = list(HEADER)
        for trait in traits:
            out += impl_of(root, paths[trait], trait)
        (dest / f"{name}.rs").write_text("\n".join(out))
    mods = [
        "//! Generated by `scripts/gen_counted.py` from burn-backend's traits: do not edit.",
        "//! `Counted<B>`'s backend traits, each method delegated to `B` (one file per group",
        "//! of traits).",
        "",
    ] + [f"mod {name};" for name in FILES]
    (dest / "mod.rs").write_text("\n".join(mods) + "\n")
    assert sorted(t for ts in FILES.values() for t in ts) == sorted(t for _, t in TRAITS)


if __name__ == "__main__":
    main()
