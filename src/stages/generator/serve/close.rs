//! Closing agent episodes (`POST /v1/rlstream/episodes/{id}/close`), and publishing the
//! groups that completes to the rollouts stream, or dead-lettering those that cannot train.

use super::super::decode::calls::CallMessage;
use super::api::{ApiError, Body};
use super::episodes::Closed;
use super::server::{Server, Timer};
use crate::roles::Stream;
use crate::schema::DeadLetter;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::sync::Arc;

/// `POST /v1/rlstream/episodes/{id}/close` with `{"reward": r, "turn_rewards": [..]}`.
pub(super) async fn close(
    State(s): State<Arc<Server>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: axum::body::Body,
) -> Response {
    let mut timer = Timer::new("close");
    let answer = async {
        let body = s.authorized_body(&headers, body).await?;
        let mut b = Body::parse(&body)?;
        let reward: f32 = b
            .take("reward")?
            .ok_or_else(|| ApiError::param("invalid_value", "reward", "`reward` is required"))?;
        let turn_rewards: Vec<f32> = b.take("turn_rewards")?.unwrap_or_default();
        b.finish()?;
        if !reward.is_finite() || turn_rewards.iter().any(|r| !r.is_finite()) {
            return Err(ApiError::param(
                "invalid_value",
                "reward",
                "rewards must be finite numbers",
            ));
        }
        let closed = s.episodes.close(&id, reward, &turn_rewards)?;
        // Its kept KV cache has no call left to continue it.
        let _ = s.calls.send(CallMessage::Forget(id.clone()));
        s.settle(closed).await
    }
    .await;
    match answer {
        Ok(mut v) => {
            timer.outcome = Some("ok");
            v["episode"] = json!(id);
            axum::Json(v).into_response()
        }
        Err(e) => {
            timer.outcome = Some(e.outcome());
            e.into_response()
        }
    }
}

impl Server {
    /// Writes one message to `stream`.
    async fn publish<M: crate::schema::Message>(
        &self,
        stream: Stream,
        message: &M,
    ) -> Result<(), ApiError> {
        let (bus, topo) = (&self.setup.bus, &self.setup.topo);
        let payload = crate::schema::encode(message).map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "encode_failed",
                e.to_string(),
            )
        })?;
        bus.publish(&topo.key(stream), &[payload.into()], topo.max_len(stream))
            .await
            .map_err(|e| {
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "bus_unavailable",
                    format!("the group could not be written to the bus: {e}"),
                )
            })?;
        Ok(())
    }

    /// Publishes a complete group to the rollouts stream, or dead-letters a group that
    /// cannot be trained; what happened, as JSON.
    pub(super) async fn settle(&self, closed: Closed) -> Result<Value, ApiError> {
        match closed {
            Closed::Waiting { closed, of } => {
                Ok(json!({"closed": closed, "of": of, "published": false}))
            }
            Closed::Publish(group) => {
                self.publish(Stream::Rollouts, &*group).await?;
                crate::metrics::generated(
                    group.samples.len() as u64,
                    group.completion_tokens() as u64,
                );
                tracing::info!(group = %group.group_id, samples = group.samples.len(), "agent group published");
                Ok(
                    json!({"closed": group.samples.len(), "published": true, "group_id": group.group_id}),
                )
            }
            Closed::Dead {
                group,
                reason,
                detail,
            } => {
                let letter = DeadLetter {
                    schema: crate::schema::SchemaVersion::CURRENT,
                    source_stream: "endpoint".into(),
                    source_id: group.clone(),
                    group: "agent".into(),
                    consumer: self.setup.gen_id.clone(),
                    reason: reason.into(),
                    error: detail.clone(),
                    deliveries: 0,
                    payload: Vec::new(),
                    dead_us: crate::schema::now_us(),
                };
                self.publish(Stream::Dead, &letter).await?;
                crate::metrics::dead_lettered("endpoint", "agent", reason, 1);
                tracing::warn!(group, reason, detail, "agent group dead-lettered");
                Ok(json!({"published": false, "dead_lettered": reason, "detail": detail}))
            }
        }
    }
}
