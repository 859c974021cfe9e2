//! `relay-nn`: the model, loss and optimizer code that must be identical in
//! the learner, the inference server and the evaluator.
//!
//! Pure: no NATS, no async, no I/O beyond reading and writing safetensors
//! files. On the CPU the models, losses and optimizers run fused kernels
//! ([`ops`], [`kernels`]); placed on a GPU (`to_device`, `policy.device`)
//! the same code runs composed from candle's basic ops, and
//! [`ops::composed_on_cpu`] checks that path on machines without one.
//!
//! | module | owns |
//! |---|---|
//! | [`spec`] | [`PolicySpec`], [`ActionKind`], [`Activation`], [`CnnSpec`] ([`CnnArch`]): what a policy looks like (serde) |
//! | [`conv`] | the convolutions of image policies and Q-networks: `im2col` + gemm, padding, max-pool, their backward passes and graph ops; `conv/cnn.rs` the features extractor built from them (NatureCNN, IMPALA's ResNet: layers, parameter names, forward passes) |
//! | `layers` | the dense layers every network builds on: creation and init, the graph-free host forward (inference) and the fused-op graph (training) |
//! | [`recurrent`] | the LSTM / GRU cores of recurrent actor-critics: acting one step without a graph, unrolling a fragment as a graph (BPTT) |
//! | [`model`] | [`ActorCritic`] (separate or shared trunk, [`TrunkLayout`]): parameters, init, `evaluate` (training), weight exchange and checkpoints; `model/act.rs` its graph-free `act` / `values` (inference); both optionally under action masks |
//! | [`ops`] | fused differentiable candle ops (linear+activation, categorical and Gaussian log-prob/entropy, squashed Gaussian sample, precomputed losses); `ops/composed.rs` the same from candle's basic ops (off the CPU); [`ops::mask`] invalid-action masking ([`mask_logits`], [`check_masks`], [`masked_argmax`]) |
//! | [`kernels`] | hand-written f32 kernels: fast `tanh`, dense layer, Adam update |
//! | [`ppo`] | [`gae`], [`ppo_loss`] and its [`PpoLossConfig`], [`explained_variance`], [`normalize`] |
//! | [`a2c`] | [`a2c_loss`], [`reinforce_loss`], [`discounted_returns`] |
//! | [`qnet`] | [`QNetwork`] (optionally dueling, optionally behind a CNN) and its [`QNetSpec`]: Q-values, epsilon-greedy acting (optionally masked), target updates |
//! | [`dqn`] | [`n_step_returns`], [`dqn_targets`], [`dqn_loss`] (double DQN, Huber, importance weights, TD errors) |
//! | [`sac`] | [`Sac`] ([`SacActor`], [`TwinCritic`] and targets, `log α`); `sac/train.rs` its losses, [`SacOptimizers`] and [`sac_train_step`] |
//! | [`schedule`] | [`Schedule`]: any hyperparameter as a function of training progress (serde) |
//! | [`vec_normalize`] | [`RunningMeanStd`], [`VecNormalize`]: SB3's observation and reward normalisation |
//! | [`device`] | [`open_device`]: the one place a device (CPU or CUDA) is opened, here and in relay-llm |
//! | [`share`] | [`BatchShare`]: a learner replica's part of each batch, the sum across replicas, and whether the learner is stopping |
//! | [`par`] | [`Pair`]: two independent halves of a train step side by side (SAC's twin critics) |
//! | [`optim`] | [`Adam`] with resumable state, the buffers and fused/composed choice both optimizers share; `optim/rmsprop.rs` [`RmsProp`]; `optim/clip.rs` [`clip_grad_norm`] |
//! | [`init`] | orthogonal initialisation |
//! | [`io`] | named f32 tensors to and from safetensors files, [`split_prefixed`] |
//! | [`error`] | [`NnError`] |
//!
//! # Threads
//!
//! candle's CPU matmul uses a rayon pool sized by `RAYON_NUM_THREADS`; on
//! small machines shared by many services set it explicitly (1 is fastest
//! for these model sizes, as `just bench-nn` shows).
//!
//! Every model keeps its parameters sorted by name in one internal
//! `params` module, which validates weight loads (all-or-nothing, errors
//! name the parameter), writes and reads checkpoints and does the
//! copy / Polyak updates of target networks.
//!
//! # Which learner uses what
//!
//! | algorithm | model | loss / step | optimizer |
//! |---|---|---|---|
//! | PPO | [`ActorCritic`] | [`gae`] + [`ppo_loss`] | [`Adam`] |
//! | A2C | [`ActorCritic`] | [`gae`] (λ = 1) + [`a2c_loss`] | [`RmsProp`] |
//! | REINFORCE | [`ActorCritic`] | [`discounted_returns`] + [`reinforce_loss`] | [`Adam`] |
//! | DQN | [`QNetwork`] ×2 | [`n_step_returns`] + [`dqn_loss`], [`QNetwork::soft_update`] | [`Adam`] |
//! | SAC | [`Sac`] | [`sac_train_step`] | [`SacOptimizers`] (3 × Adam) |
//!
//! Any of them may take [`Schedule`]d hyperparameters and a [`VecNormalize`].
//!
//! # A training step
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use relay_nn::{ppo_loss, clip_grad_norm, ActorCritic, Adam, AdamConfig, PolicySpec, PpoInputs, PpoLossConfig};
//!
//! let model = ActorCritic::new(&PolicySpec::discrete(4, 2), 0)?;
//! let mut opt = Adam::new(model.vars(), AdamConfig::default())?;
//! let obs = Tensor::zeros((3, 4), candle_core::DType::F32, &Device::Cpu)?;
//! let actions = Tensor::new(&[0u32, 1, 1], &Device::Cpu)?;
//! let (logprob, entropy, values) = model.evaluate(&obs, &actions)?;
//! let out = ppo_loss(
//!     &PpoLossConfig::default(),
//!     &PpoInputs {
//!         logprob: &logprob, entropy: &entropy, values: &values,
//!         old_logprob: &[-0.69, -0.69, -0.69], old_values: &[0.0; 3],
//!         advantages: &[1.0, -1.0, 0.5], returns: &[1.0, -1.0, 0.5],
//!     },
//! )?;
//! let mut grads = out.loss.backward()?;
//! let _norm = clip_grad_norm(&mut grads, opt.vars(), 0.5)?;
//! opt.step(&grads)?;
//! # Ok::<(), relay_nn::NnError>(())
//! ```

pub mod a2c;
pub mod conv;
pub mod device;
pub mod dqn;
pub mod error;
pub mod gsde;
pub mod init;
pub mod io;
pub mod kernels;
pub(crate) mod layers;
pub mod model;
pub mod ops;
pub mod optim;
pub mod par;
pub(crate) mod params;
pub mod ppo;
pub mod qnet;
pub mod recurrent;
pub mod sac;
pub mod share;
pub use relay_config::hyper::schedule;
pub mod spec;
pub mod vec_normalize;

pub use a2c::{
    a2c_loss, discounted_returns, reinforce_loss, A2cInputs, A2cLossConfig, PgLoss, PgStats,
    ReinforceConfig, ReinforceInputs,
};
pub use device::{open_device, DeviceError, DeviceSpec};
pub use dqn::{
    dqn_loss, dqn_targets, n_step_returns, DqnBatch, DqnLoss, DqnLossConfig, DqnStats, NStepReturns,
};
pub use error::{NnError, Result, ShareError};
pub use io::{from_safetensors, split_prefixed, to_safetensors, NamedTensor};
pub use model::{ActOutput, Actions, ActorCritic, TrunkLayout};
pub use ops::{check_masks, mask_logits, masked_argmax, MASKED_LOGIT};
pub use optim::{
    clip_grad_norm, Adam, AdamConfig, AdamState, RmsProp, RmsPropConfig, RmsPropState,
};
pub use par::Pair;
pub use ppo::{
    explained_variance, gae, normalize, ppo_loss, PpoInputs, PpoLoss, PpoLossConfig, PpoStats,
};
pub use qnet::{QNetSpec, QNetwork};
pub use sac::{
    sac_actor_loss, sac_critic_loss, sac_ent_coef_loss, sac_targets, sac_train_step,
    sac_train_step_part, ActorSample, Sac, SacActor, SacBatch, SacConfig, SacOptimizers, SacSpec,
    SacStats, TwinCritic,
};
pub use schedule::{Schedule, Shape, Warmup};
pub use share::{BatchShare, StopCheck, SumAcross};
pub use spec::{
    ActionKind, Activation, CellKind, CnnArch, CnnSpec, ConvSpec, PolicySpec, RecurrentSpec,
};
pub use vec_normalize::{NormDelta, NormalizeConfig, RunningMeanStd, VecNormalize};
