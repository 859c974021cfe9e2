//! Helpers shared by the integration tests of `relay-llm`.

use candle_core::{Device, Tensor};
use relay_llm::{token_log_probs, CausalLm, LoraAdapter};

/// Log-probs of `completion` after `prompt` under `model` with `adapter`
/// (per completion token), from the training forward.
pub fn completion_logprobs(
    model: &CausalLm,
    adapter: Option<&LoraAdapter>,
    prompt: &[u32],
    completion: &[u32],
) -> Vec<f32> {
    let seq: Vec<u32> = prompt.iter().chain(completion).copied().collect();
    let n = seq.len();
    let input = Tensor::new(&seq[..n - 1], &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let targets = Tensor::new(&seq[1..], &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let logits = model.forward_train(&input, adapter).unwrap().detach();
    let lp: Vec<f32> = token_log_probs(&logits, &targets.to_device(logits.device()).unwrap())
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec1()
        .unwrap();
    lp[prompt.len() - 1..].to_vec()
}
