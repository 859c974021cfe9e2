//! The kernels against naive loops (the fast tanh against `f32::tanh`),
//! the generic and the machine's vector versions against each other,
//! and the activation gradients. In their own file so that the kernels
//! read without them.

use super::*;

#[test]
fn fast_tanh_is_accurate() {
    let mut xs: Vec<f32> = (-200_000..=200_000).map(|i| i as f32 * 1e-4).collect();
    xs.extend([
        1e-8,
        -1e-8,
        3.9e-4,
        4.1e-4,
        0.625,
        -0.625,
        50.0,
        -50.0,
        f32::MAX,
        f32::MIN,
        0.0,
    ]);
    xs.extend((1..200).map(|i| 1e-6 * 1.07f32.powi(i)));
    let mut ys = xs.clone();
    tanh_inplace(&mut ys);
    // Relative error in units of f32 epsilon (~ ULP).
    let (mut max_vec, mut max_scalar) = (0f64, 0f64);
    for (&x, &y) in xs.iter().zip(&ys) {
        let exact = (x as f64).tanh();
        let ulp = f32::EPSILON as f64 * exact.abs().max(f32::MIN_POSITIVE as f64);
        max_vec = max_vec.max((y as f64 - exact).abs() / ulp);
        max_scalar = max_scalar.max((tanh_scalar(x) as f64 - exact).abs() / ulp);
        assert!(y.abs() <= 1.0, "tanh({x}) = {y}");
    }
    eprintln!("max error in ULP: dispatched {max_vec:.2}, portable scalar {max_scalar:.2}");
    assert!(
        max_vec <= 2.0 && max_scalar <= 2.0,
        "{max_vec} {max_scalar}"
    );
    for w in ys.windows(2).take(400_000) {
        assert!(w[1] >= w[0], "not monotone: {w:?}");
    }
    let mut nan = [f32::NAN];
    tanh_inplace(&mut nan);
    assert!(nan[0].is_nan());
}

#[test]
fn dense_matches_naive() {
    for &(rows, inp, outw) in &[(1, 4, 64), (7, 64, 64), (9, 13, 3), (4, 8, 1), (64, 64, 2)] {
        let x: Vec<f32> = (0..rows * inp)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect();
        let w: Vec<f32> = (0..outw * inp)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 97.0)
            .collect();
        let b: Vec<f32> = (0..outw).map(|i| i as f32 * 0.01 - 0.2).collect();
        for act in [None, Some(Activation::Tanh), Some(Activation::Relu)] {
            let mut out = vec![0f32; rows * outw];
            dense(&x, inp, &w, &b, &mut out, act);
            let mut portable = vec![0f32; rows * outw];
            dense_generic::<false>(&x, inp, &w, &b, &mut portable, act);
            for (p, q) in out.iter().zip(&portable) {
                assert!(
                    (p - q).abs() < 1e-5 * (1.0 + q.abs()),
                    "dispatched {p} vs portable {q}"
                );
            }
            for r in 0..rows {
                for j in 0..outw {
                    let mut s = b[j] as f64;
                    for k in 0..inp {
                        s += x[r * inp + k] as f64 * w[j * inp + k] as f64;
                    }
                    let e = match act {
                        None => s,
                        Some(Activation::Tanh) => s.tanh(),
                        Some(Activation::Relu) => s.max(0.0),
                    };
                    let got = out[r * outw + j] as f64;
                    assert!(
                        (got - e).abs() < 1e-5 * (1.0 + e.abs()),
                        "{rows}x{inp}x{outw} {act:?}: {got} vs {e}"
                    );
                }
            }
        }
    }
}

/// Every compiled version (portable, AVX2, AVX-512) of the elementwise
/// kernels gives the same results, whatever this CPU dispatches to.
#[test]
fn all_versions_agree() {
    let x: Vec<f32> = (0..1003)
        .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) / 150.0)
        .collect();
    let g: Vec<f32> = (0..1003)
        .map(|i| ((i * 31 % 17) as f32 - 8.0) / 4.0)
        .collect();
    let y: Vec<f32> = x.iter().map(|v| v.tanh()).collect();
    let reference = |f: &dyn Fn(&mut Vec<f32>)| {
        let mut v = x.clone();
        f(&mut v);
        v
    };
    let tanh_ref = reference(&|v| tanh_inplace_generic::<false>(v));
    let mut tg_ref = vec![0f32; x.len()];
    tanh_grad_generic(&y, &g, &mut tg_ref);
    let mut cs_ref = vec![0f32; 17];
    column_sums_generic(&x[..17 * 59], &mut cs_ref);
    let coeffs = AdamCoeffs {
        beta1: 0.9,
        beta2: 0.999,
        step_size: 1e-3,
        inv_bc2_sqrt: 1.5,
        eps: 1e-5,
        weight_decay: 0.01,
    };
    type AdamFn<'a> = &'a dyn Fn(&mut [f32], &[f32], &mut [f32], &mut [f32]);
    let adam_run = |f: AdamFn<'_>| {
        let (mut p, mut m, mut v) = (
            x.clone(),
            g.clone(),
            y.iter().map(|a| a * a).collect::<Vec<_>>(),
        );
        f(&mut p, &g, &mut m, &mut v);
        (p, m, v)
    };
    let adam_ref = adam_run(&|p, g, m, v| adam_generic::<false>(p, g, m, v, coeffs));
    let close = |a: &[f32], b: &[f32], tol: f32| {
        for (p, q) in a.iter().zip(b) {
            assert!((p - q).abs() <= tol * (1.0 + q.abs()), "{p} vs {q}");
        }
    };
    #[cfg(target_arch = "x86_64")]
    {
        let lvl = x86::level();
        for wide in [false, true] {
            if (wide && lvl != x86::Level::Avx512) || lvl == x86::Level::Portable {
                continue;
            }
            // SAFETY: guarded by the level check above.
            unsafe {
                let mut t = x.clone();
                if wide {
                    x86::tanh_inplace_512(&mut t)
                } else {
                    x86::tanh_inplace(&mut t)
                }
                close(&t, &tanh_ref, 3e-7);
                let mut tg = vec![0f32; x.len()];
                if wide {
                    x86::tanh_grad_512(&y, &g, &mut tg)
                } else {
                    x86::tanh_grad(&y, &g, &mut tg)
                }
                close(&tg, &tg_ref, 1e-6);
                let mut cs = vec![0f32; 17];
                if wide {
                    x86::column_sums_512(&x[..17 * 59], &mut cs)
                } else {
                    x86::column_sums(&x[..17 * 59], &mut cs)
                }
                close(&cs, &cs_ref, 1e-5);
                let got = adam_run(&|p, g, m, v| {
                    if wide {
                        x86::adam_512(p, g, m, v, coeffs)
                    } else {
                        x86::adam(p, g, m, v, coeffs)
                    }
                });
                close(&got.0, &adam_ref.0, 1e-6);
                close(&got.1, &adam_ref.1, 1e-6);
                close(&got.2, &adam_ref.2, 1e-6);
            }
        }
    }
    // The public entry points agree with the portable versions too.
    let mut t = x.clone();
    tanh_inplace(&mut t);
    close(&t, &tanh_ref, 3e-7);
    let mut cs = vec![0f32; 17];
    column_sums(&x[..17 * 59], &mut cs);
    close(&cs, &cs_ref, 1e-5);
}

#[test]
fn grads() {
    let y = [0.5f32, -0.25, 0.0, 0.9];
    let g = [1.0f32, 2.0, -1.0, 0.5];
    let mut out = [0f32; 4];
    tanh_grad(&y, &g, &mut out);
    for (o, e) in out
        .iter()
        .zip([0.75, 2.0 * (1.0 - 0.0625), -1.0, 0.5 * (1.0 - 0.81)])
    {
        assert!((o - e).abs() < 1e-6, "{out:?}");
    }
    relu_grad(&y, &g, &mut out);
    assert_eq!(out, [1.0, 0.0, 0.0, 0.5]);
}

#[test]
fn relu_zeroes_negatives_and_keeps_nan() {
    // Longer than one vector, with a tail.
    let mut x: Vec<f32> = (0..37).map(|i| i as f32 - 18.0).collect();
    x[5] = f32::NAN;
    let mut expected: Vec<f32> = x.iter().map(|v| if *v < 0.0 { 0.0 } else { *v }).collect();
    relu_inplace(&mut x);
    assert!(x[5].is_nan());
    (x[5], expected[5]) = (0.0, 0.0);
    assert_eq!(x, expected);
}
