//! Each kernel against its composition, forward and backward, on random inputs:
//!
//! - `Autodiff<NdArray>` runs the native kernels inside one graph node each;
//! - `Autodiff<Counted<NdArray>>` runs the composed forward (the trait's provided methods,
//!   as on every backend without native kernels) and the written-out backward inside one
//!   node;
//!
//! both are compared with burn differentiating the composition itself, operation by
//! operation. A wrong native kernel or a wrong derivative fails here.

use super::logprob::{HeadTargets, Kept, MASKED};
use super::{Kernels, reference};
use crate::model::counted::Counted;
use burn::backend::{Autodiff, NdArray};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, Tensor, TensorData};

fn values<B: AutodiffBackend, const D: usize>(t: &Tensor<B, D>) -> Vec<f32> {
    t.to_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .unwrap_or_default()
}

fn close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    assert!(!a.is_empty(), "{what}: empty");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let bound = tol * (1.0 + x.abs().max(y.abs()));
        assert!((x - y).abs() <= bound, "{what}[{i}]: {x} vs {y}");
    }
}

fn random<B: AutodiffBackend, const D: usize>(shape: [usize; D], seed: u64) -> Tensor<B, D> {
    B::seed(&Default::default(), seed);
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), &Default::default())
}

/// `Σ out · w` for a fixed random `w`, so every output element gets its own gradient.
fn weighted<B: AutodiffBackend, const D: usize>(out: Tensor<B, D>, seed: u64) -> Tensor<B, 1> {
    let w = random::<B, D>(out.dims(), seed).detach();
    (out * w).sum()
}

/// Forward values and the gradients of `inputs` from `f`, then from `g`, compared.
fn check<B, const D: usize, const E: usize>(
    inputs: Vec<Tensor<B, D>>,
    f: impl Fn(&[Tensor<B, D>]) -> Tensor<B, E>,
    g: impl Fn(&[Tensor<B, D>]) -> Tensor<B, E>,
    tol: f32,
    what: &str,
) where
    B: AutodiffBackend + Kernels,
{
    let run = |h: &dyn Fn(&[Tensor<B, D>]) -> Tensor<B, E>| {
        let xs: Vec<Tensor<B, D>> = inputs
            .iter()
            .map(|x| x.clone().detach().require_grad())
            .collect();
        let out = h(&xs);
        let fwd = values(&out);
        let grads = weighted(out, 99).backward();
        let dx: Vec<Vec<f32>> = xs
            .iter()
            .map(|x| {
                x.grad(&grads)
                    .map(|g| {
                        g.to_data()
                            .convert::<f32>()
                            .into_vec::<f32>()
                            .unwrap_or_default()
                    })
                    .unwrap_or_default()
            })
            .collect();
        (fwd, dx)
    };
    let (fa, ga) = run(&f);
    let (fb, gb) = run(&g);
    close(&fa, &fb, tol, &format!("{what} forward"));
    for (i, (a, b)) in ga.iter().zip(&gb).enumerate() {
        close(a, b, tol, &format!("{what} gradient of input {i}"));
    }
}

fn linear<B: AutodiffBackend + Kernels>() {
    let x = random::<B, 2>([19, 12], 13);
    let w = random::<B, 2>([12, 9], 14);
    let bias = random::<B, 2>([1, 9], 15);
    check(
        vec![x.clone(), w.clone(), bias],
        |v| B::linear_rows(v[0].clone(), v[1].clone(), Some(v[2].clone().reshape([9]))),
        |v| reference::linear(v[0].clone(), v[1].clone(), Some(v[2].clone().reshape([9]))),
        1e-5,
        "linear with bias",
    );
    // A transposed view as the input (what a strided caller hands over).
    let xt = random::<B, 2>([12, 19], 16);
    check(
        vec![xt, w],
        |v| B::linear_rows(v[0].clone().transpose(), v[1].clone(), None),
        |v| reference::linear(v[0].clone().transpose(), v[1].clone(), None),
        1e-5,
        "linear without bias",
    );
    // A transposed weight: a tied embedding `[vocab, hidden]` read as the output head,
    // whose gradient the CPU kernel writes in the embedding's own layout.
    let x = random::<B, 2>([19, 12], 17);
    let embedding = random::<B, 2>([30, 12], 18);
    check(
        vec![x, embedding],
        |v| B::linear_rows(v[0].clone(), v[1].clone().transpose(), None),
        |v| reference::linear(v[0].clone(), v[1].clone().transpose(), None),
        1e-5,
        "linear on a transposed weight",
    );
}

fn rms_norm<B: AutodiffBackend + Kernels>() {
    let x = random::<B, 2>([37, 24], 1);
    let gamma = random::<B, 2>([1, 24], 2);
    check(
        vec![x, gamma],
        |v| B::rms_norm(v[0].clone(), v[1].clone().reshape([24]), 1e-6),
        |v| reference::rms_norm(v[0].clone(), v[1].clone().reshape([24]), 1e-6),
        1e-5,
        "rms_norm",
    );
}

fn rope<B: AutodiffBackend + Kernels>() {
    let (b, l, h, hd) = (3, 5, 4, 8);
    let x = random::<B, 4>([b, l, h, hd], 3);
    // Tables in the HF layout (both halves alike) and not (halves differ): the kernel and
    // its backward may not assume either.
    for (seed, halves_alike) in [(4, true), (5, false)] {
        let mut cos = values(&random::<B, 3>([b, l, hd], seed));
        let mut sin = values(&random::<B, 3>([b, l, hd], seed + 10));
        if halves_alike {
            for row in 0..b * l {
                for j in 0..hd / 2 {
                    cos[row * hd + j + hd / 2] = cos[row * hd + j];
                    sin[row * hd + j + hd / 2] = sin[row * hd + j];
                }
            }
        }
        let dev = Default::default();
        let cos = Tensor::<B, 3>::from_data(TensorData::new(cos, [b, l, hd]), &dev);
        let sin = Tensor::<B, 3>::from_data(TensorData::new(sin, [b, l, hd]), &dev);
        check(
            vec![x.clone()],
            |v| B::rope(v[0].clone(), cos.clone(), sin.clone()),
            |v| reference::rope(v[0].clone(), cos.clone(), sin.clone()),
            1e-5,
            "rope",
        );
    }
}

fn attn_softmax<B: AutodiffBackend + Kernels>() {
    let (b, m, l) = (2, 3, 6);
    let t = l;
    let scores = random::<B, 4>([b, m, l, t], 6);
    let dev = Default::default();
    // Causal, broadcast over the batch, and one bias per row (padding before a start).
    let causal: Vec<f32> = (0..l)
        .flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { MASKED }))
        .collect();
    let per_row: Vec<f32> = (0..b)
        .flat_map(|r| {
            (0..l)
                .flat_map(move |i| (0..t).map(move |j| if j <= i && j >= r { 0.0 } else { MASKED }))
        })
        .collect();
    for (bias, rows) in [(causal, 1), (per_row, b)] {
        let bias = Tensor::<B, 4>::from_data(TensorData::new(bias, [rows, 1, l, t]), &dev);
        check(
            vec![scores.clone()],
            |v| B::attn_softmax(v[0].clone(), bias.clone(), 0.35),
            |v| reference::attn_softmax(v[0].clone(), bias.clone(), 0.35),
            1e-5,
            "attn_softmax",
        );
    }
}

fn swiglu<B: AutodiffBackend + Kernels>() {
    // More values than one parallel chunk, and not a multiple of it.
    let gate = random::<B, 2>([9, 1000], 7).mul_scalar(3.0);
    let up = random::<B, 2>([9, 1000], 8);
    check(
        vec![gate, up],
        |v| B::swiglu(v[0].clone(), v[1].clone()),
        |v| reference::swiglu(v[0].clone(), v[1].clone()),
        1e-5,
        "swiglu",
    );
}

fn token_logprobs<B: AutodiffBackend + Kernels>() {
    let logits = random::<B, 2>([7, 50], 9).mul_scalar(4.0);
    let targets = [0u32, 49, 3, 17, 17, 25, 8];
    // Rows 1 and 4 renormalised over a few ids (their target among them), the rest over
    // the vocabulary.
    let sets: [&[u32]; 7] = [&[], &[2, 49, 7], &[], &[], &[40, 17], &[], &[]];
    for kept in [Kept::whole(7), Kept::of(sets)] {
        let mut bias = vec![0f32; 7 * 50];
        for (i, row) in bias.chunks_exact_mut(50).enumerate() {
            if !kept.row(i).is_empty() {
                row.fill(MASKED);
                kept.row(i).iter().for_each(|&id| row[id as usize] = 0.0);
            }
        }
        let bias = Tensor::<B, 2>::from_data(TensorData::new(bias, [7, 50]), &Default::default());
        for temperature in [1.0f32, 0.7, 0.0] {
            check(
                vec![logits.clone()],
                |v| B::token_logprobs(v[0].clone(), &targets, temperature, &kept),
                |v| {
                    let z = if temperature > 0.0 && temperature != 1.0 {
                        v[0].clone().mul_scalar(1.0 / temperature)
                    } else {
                        v[0].clone()
                    };
                    let ids = Tensor::from_data(
                        TensorData::new(
                            targets.iter().map(|&t| i64::from(t)).collect::<Vec<_>>(),
                            [7, 1],
                        ),
                        &Default::default(),
                    );
                    z.clone().gather(1, ids) - reference::logsumexp(z + bias.clone())
                },
                1e-5,
                "token_logprobs",
            );
        }
    }
}

fn attention<B: AutodiffBackend + Kernels>() {
    // Two kv heads of two query heads each; one new token after 5 cached ones per row with
    // padding before each row's start, and a causal pass.
    let (b, kvh, g, hd) = (2, 2, 2, 8);
    let dev = Default::default();
    // The longer ones span several query blocks of the backward, a block crossing from one
    // query head's rows to the next.
    for (l, t, per_row) in [
        (6, 6, false),
        (1, 6, true),
        (3, 6, true),
        (150, 150, false),
        (70, 100, true),
    ] {
        let bias: Vec<f32> = (0..if per_row { b } else { 1 })
            .flat_map(|r| {
                (0..l).flat_map(move |i| {
                    (0..t).map(move |j| {
                        let visible = j <= t - l + i && (!per_row || j >= r);
                        if visible { 0.0 } else { MASKED }
                    })
                })
            })
            .collect();
        let rows = if per_row { b } else { 1 };
        let bias = Tensor::<B, 4>::from_data(TensorData::new(bias, [rows, 1, l, t]), &dev);
        let q = random::<B, 4>([b, kvh, g * l, hd], 13);
        let k = random::<B, 4>([b, kvh, t, hd], 14);
        let v = random::<B, 4>([b, kvh, t, hd], 15);
        check(
            vec![q, k, v],
            |x| B::attn(x[0].clone(), x[1].clone(), x[2].clone(), bias.clone(), 0.35),
            |x| {
                let scores =
                    x[0].clone()
                        .matmul(x[1].clone().swap_dims(2, 3))
                        .reshape([b, kvh * g, l, t]);
                let probs = reference::attn_softmax(scores, bias.clone(), 0.35);
                probs.reshape([b, kvh, g * l, t]).matmul(x[2].clone())
            },
            1e-5,
            "attention",
        );
    }
}

/// The chunked head against the head and the log-prob composed (one product, one
/// log-softmax over all rows): 7 rows in chunks of 3, through a row-major head and through
/// a transposed view (a tied embedding).
fn head_logprobs<B: AutodiffBackend + Kernels>() {
    let x = random::<B, 2>([7, 6], 21);
    let w = random::<B, 2>([6, 50], 22);
    let targets = [0u32, 49, 3, 17, 17, 25, 8];
    let sets: [&[u32]; 7] = [&[], &[2, 49, 7], &[], &[], &[40, 17], &[], &[]];
    let kept = Kept::of(sets);
    let plain = |x: Tensor<B, 2>, w: Tensor<B, 2>| {
        B::token_logprobs(reference::linear(x, w, None), &targets, 0.7, &kept)
    };
    // A row-major `[hidden, vocab]` head, then a tied embedding `[vocab, hidden]` read
    // transposed.
    let tied = random::<B, 2>([50, 6], 23);
    for (weight, transposed) in [(w, false), (tied, true)] {
        let head = move |v: &Tensor<B, 2>| {
            if transposed {
                v.clone().transpose()
            } else {
                v.clone()
            }
        };
        check(
            vec![x.clone(), weight],
            |v| {
                let t = HeadTargets {
                    targets: &targets,
                    temperature: 0.7,
                    kept: &kept,
                    chunk: 3,
                };
                B::head_logprobs(v[0].clone(), head(&v[1]), t)
            },
            |v| plain(v[0].clone(), head(&v[1])),
            1e-5,
            "head_logprobs",
        );
    }
}

type Native = Autodiff<NdArray>;
type Composed = Autodiff<Counted<NdArray>>;

#[test]
fn linear_native_and_written_out_backward_match_the_composition() {
    linear::<Native>();
    linear::<Composed>();
}

#[test]
fn rms_norm_native_and_written_out_backward_match_the_composition() {
    rms_norm::<Native>();
    rms_norm::<Composed>();
}

#[test]
fn rope_native_and_written_out_backward_match_the_composition() {
    rope::<Native>();
    rope::<Composed>();
}

#[test]
fn attention_softmax_native_and_written_out_backward_match_the_composition() {
    attn_softmax::<Native>();
    attn_softmax::<Composed>();
}

#[test]
fn attention_native_and_written_out_backward_match_the_composition() {
    attention::<Native>();
    attention::<Composed>();
}

#[test]
fn swiglu_native_and_written_out_backward_match_the_composition() {
    swiglu::<Native>();
    swiglu::<Composed>();
}

#[test]
fn token_logprobs_native_and_written_out_backward_match_the_composition() {
    token_logprobs::<Native>();
    token_logprobs::<Composed>();
}

#[test]
fn head_logprobs_in_chunks_match_the_composition() {
    head_logprobs::<Native>();
    head_logprobs::<Composed>();
}

/// On the CPU each row's log-prob is the same in any chunking, bit for bit, and equals
/// [`token_logprob`](super::token_logprob) of that row's logits from the linear kernel
/// alone: what the sampler records.
#[test]
fn head_logprobs_are_bitwise_whatever_the_chunk() {
    let device = Default::default();
    let x = Tensor::<NdArray, 2>::random([40, 16], Distribution::Normal(0.0, 1.0), &device);
    let emb = Tensor::<NdArray, 2>::random([300, 16], Distribution::Normal(0.0, 1.0), &device);
    let targets: Vec<u32> = (0..40).map(|i| (i * 7) % 300).collect();
    let kept = Kept::whole(40);
    let lp = |chunk| {
        let h = HeadTargets {
            targets: &targets,
            temperature: 0.8,
            kept: &kept,
            chunk,
        };
        let t = NdArray::head_logprobs(x.clone(), emb.clone().transpose(), h);
        t.into_data().into_vec::<f32>().unwrap_or_default()
    };
    let whole = lp(40);
    for chunk in [1, 3, 16, 39] {
        assert_eq!(lp(chunk), whole, "chunk {chunk}");
    }
    for i in [0usize, 17, 39] {
        let row = NdArray::linear_rows(x.clone().slice(i..i + 1), emb.clone().transpose(), None);
        let row = row.into_data().into_vec::<f32>().unwrap_or_default();
        let (want, _) = super::token_logprob(&row, targets[i] as usize, 0.8, &[]);
        assert_eq!(whole[i].to_bits(), want.to_bits(), "row {i}");
    }
}

#[test]
fn a_kernel_that_is_wrong_fails_the_comparison() {
    // The comparison itself can fail: an RMSNorm without its gamma does not pass as one.
    let x = random::<Native, 2>([4, 8], 11);
    let gamma = random::<Native, 2>([1, 8], 12);
    let wrong = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        check(
            vec![x, gamma],
            |v| Native::rms_norm(v[0].clone(), v[1].clone().reshape([8]), 1e-6),
            |v| reference::rms_norm(v[0].clone(), v[1].clone().reshape([8]).ones_like(), 1e-6),
            1e-5,
            "wrong",
        )
    }));
    assert!(wrong.is_err());
}

/// The cache's column join gives burn's concatenation, empty sides and a strided (swapped)
/// operand included.
#[test]
fn cat_columns_is_the_concatenation() {
    let device = Default::default();
    let t = |shape: [usize; 4]| {
        Tensor::<NdArray, 4>::random(shape, Distribution::Normal(0.0, 1.0), &device)
    };
    let swapped = t([3, 1, 2, 4]).swap_dims(1, 2);
    for (a, b) in [
        (t([3, 2, 5, 4]), t([3, 2, 1, 4])),
        (t([3, 2, 0, 4]), t([3, 2, 6, 4])),
        (t([3, 2, 5, 4]), t([3, 2, 0, 4])),
        (t([3, 2, 5, 4]), swapped),
        (t([0, 2, 5, 4]), t([0, 2, 1, 4])),
    ] {
        let want = Tensor::cat(vec![a.clone(), b.clone()], 2);
        let got = <NdArray as Kernels>::cat_columns(a, b);
        assert_eq!(got.dims(), want.dims());
        assert_eq!(got.into_data(), want.into_data());
    }
}

fn reshape<B: AutodiffBackend + Kernels>() {
    let x = random::<B, 3>([3, 5, 8], 41);
    check(
        vec![x],
        |v| super::reshape(super::reshape(v[0].clone(), [15, 8]) * 2.0, [3, 5, 8]),
        |v| (v[0].clone().reshape([15, 8]) * 2.0).reshape([3, 5, 8]),
        0.0,
        "reshape",
    );
    // A strided view (a transposed one) takes burn's copying reshape.
    let x = random::<B, 3>([4, 6, 2], 42);
    check(
        vec![x],
        |v| super::reshape(v[0].clone().swap_dims(0, 1), [24, 2]),
        |v| v[0].clone().swap_dims(0, 1).reshape([24, 2]),
        0.0,
        "reshape of a transposed view",
    );
}

#[test]
fn reshape_native_and_composed_match_burns_reshape() {
    reshape::<Native>();
    reshape::<Composed>();
}

/// The address of a CPU tensor's first value.
fn first_value<const D: usize>(t: Tensor<NdArray, D>) -> *const f32 {
    match t.into_primitive().tensor() {
        burn::backend::ndarray::NdArrayTensor::F32(s) => s.view().as_ptr(),
        _ => unreachable!("an f32 tensor"),
    }
}

/// On the CPU backend a contiguous tensor keeps its buffer through [`super::reshape`]
/// (burn's own reshape copies it), forward and, through `Autodiff`, backward.
#[test]
fn reshape_on_the_cpu_shares_the_buffer() {
    let x = Tensor::<NdArray, 3>::from_data(
        TensorData::new((0..24).map(|v| v as f32).collect(), [2, 3, 4]),
        &Default::default(),
    );
    let at = first_value(x.clone());
    let rows = super::reshape(x.clone(), [6, 4]);
    assert_eq!(
        first_value(rows.clone()),
        at,
        "the reshape shares the buffer"
    );
    assert_ne!(first_value(x.reshape([6, 4])), at, "burn's reshape copies");
    assert_eq!(
        values_of(rows),
        (0..24).map(|v| v as f32).collect::<Vec<_>>()
    );
    // Through Autodiff: the gradient reaching the input is the output's, reshaped.
    let x = Tensor::<Autodiff<NdArray>, 3>::ones([2, 3, 4], &Default::default()).require_grad();
    let grads = (super::reshape(x.clone(), [6, 4]) * 3.0).sum().backward();
    let dx = x
        .grad(&grads)
        .map(|g| g.to_data().to_vec::<f32>().unwrap_or_default());
    assert_eq!(dx, Some(vec![3.0; 24]));
}

fn values_of(t: Tensor<NdArray, 2>) -> Vec<f32> {
    t.to_data().to_vec::<f32>().unwrap_or_default()
}
