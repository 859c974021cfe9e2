//! Stand-ins for the learner and the replay buffer, for tests that run an
//! env-runner and inference servers against a real nats-server and check
//! what the env-runner ships against the model in one process.

use std::sync::{Arc, Mutex};

use futures::StreamExt;
use relay_nn::ActorCritic;
use relay_proto::{decode, encode, InsertAck, RolloutFragment, Subjects, SCHEMA_VERSION};

/// Answers run `run`'s `weights.latest` with version 0 of `model`, as the
/// learner does.
pub fn spawn_stand_in_learner(client: async_nats::Client, run: &str, model: &ActorCritic) {
    let latest = encode(&relay_policy::PolicyWeights::of(model, 0, 0).inline_update());
    let subject = Subjects::new(run).weights_latest();
    tokio::spawn(async move {
        let mut requests = client.subscribe(subject).await.unwrap();
        while let Some(m) = requests.next().await {
            let _ = client
                .publish(m.reply.unwrap(), latest.clone().into())
                .await;
        }
    });
}

/// Stores every fragment inserted into run `run`, acknowledging it as the
/// buffer does.
pub fn spawn_stand_in_replay(
    client: async_nats::Client,
    run: &str,
    stored: Arc<Mutex<Vec<RolloutFragment>>>,
) {
    let subject = Subjects::new(run).replay_insert();
    tokio::spawn(async move {
        let mut inserts = client.subscribe(subject).await.unwrap();
        while let Some(m) = inserts.next().await {
            stored.lock().unwrap().push(decode(&m.payload).unwrap());
            let ack = InsertAck {
                schema: SCHEMA_VERSION,
                accepted: true,
                retry_after_ms: 0,
                buffered_steps: 0,
                reason: String::new(),
            };
            let _ = client.publish(m.reply.unwrap(), encode(&ack).into()).await;
        }
    });
}
