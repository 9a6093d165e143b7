//! OpenAI's request and response bodies for `/v1/completions` and `/v1/chat/completions`,
//! and its error body, as the endpoint reads and writes them.
//!
//! Requests are read field by field from the JSON object, so every refusal names the
//! parameter: a field rlstream does not implement is refused (400, `unsupported_parameter`)
//! unless it is set to what OpenAI does by default (a penalty of 0, an empty `logit_bias`),
//! so a client that spells out defaults still works. Each choice of a response carries,
//! besides OpenAI's fields, an `rlstream` object: the prompt's and the completion's token
//! ids, each completion token's log-prob under the distribution it was drawn from, and the
//! policy version that drew it.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};

/// An OpenAI-style error: its status and `{"error": {message, type, param, code}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub code: &'static str,
    pub param: Option<String>,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        let kind = match status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        };
        ApiError {
            status,
            kind,
            code,
            param: None,
            message: message.into(),
        }
    }

    /// A 400 about parameter `param`.
    pub fn param(code: &'static str, param: &str, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param.to_string()),
            ..ApiError::new(StatusCode::BAD_REQUEST, code, message)
        }
    }

    /// The outcome label of the request metric.
    pub fn outcome(&self) -> &'static str {
        self.code
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl From<super::episodes::EpisodeRefusal> for ApiError {
    fn from(r: super::episodes::EpisodeRefusal) -> Self {
        let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::BAD_REQUEST);
        ApiError::new(status, r.code, r.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// Fields OpenAI clients may send that change nothing here when left at OpenAI's default
/// (the value that means "off"); any other value is refused.
const NEUTRAL: &[&str] = &[
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "best_of",
    "echo",
    "suffix",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
];

/// Fields that only describe the request and are ignored.
const IGNORED: &[&str] = &["user", "metadata", "store", "service_tier"];

/// Whether `v` is the "off" value of a field in [`NEUTRAL`].
fn is_off(key: &str, v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0) || (key == "best_of" && n.as_u64() == Some(1)),
        Value::String(s) => s.is_empty() || (key == "tool_choice" && s == "none"),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => {
            o.is_empty() || (key == "response_format" && o.get("type") == Some(&json!("text")))
        }
    }
}

/// A request body's fields, taken one by one; what is left is refused.
pub struct Body(Map<String, Value>);

impl Body {
    pub fn parse(bytes: &[u8]) -> Result<Self, ApiError> {
        let v: Value = serde_json::from_slice(bytes).map_err(|e| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_json",
                format!("the request body is not JSON: {e}"),
            )
        })?;
        match v {
            Value::Object(m) => Ok(Body(m)),
            _ => Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_json",
                "the request body must be a JSON object",
            )),
        }
    }

    /// Field `key` (absent and `null` are both `None`).
    pub fn take<T: DeserializeOwned>(&mut self, key: &str) -> Result<Option<T>, ApiError> {
        match self.0.remove(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => serde_json::from_value(v).map(Some).map_err(|e| {
                ApiError::param(
                    "invalid_type",
                    key,
                    format!("`{key}` has the wrong type: {e}"),
                )
            }),
        }
    }

    /// Field `key`, the raw JSON.
    pub fn take_value(&mut self, key: &str) -> Option<Value> {
        self.0.remove(key).filter(|v| !v.is_null())
    }

    /// Refuses any field left that is not ignored or at its "off" value.
    pub fn finish(self) -> Result<(), ApiError> {
        let mut left: Vec<(&String, &Value)> = self
            .0
            .iter()
            .filter(|(k, v)| {
                !(IGNORED.contains(&k.as_str()) || NEUTRAL.contains(&k.as_str()) && is_off(k, v))
            })
            .collect();
        left.sort_by_key(|(k, _)| *k);
        match left.first() {
            None => Ok(()),
            Some((k, _)) => Err(ApiError::param(
                "unsupported_parameter",
                k,
                format!("`{k}` is not supported by this endpoint (see docs/agents.md)"),
            )),
        }
    }
}

/// Sampling as a request asks for it (after defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct CallSampling {
    pub n: usize,
    /// `None`: the policy's temperature.
    pub temperature: Option<f32>,
    pub top_p: f32,
    pub top_k: u32,
    /// `None`: what the context leaves (chat), or 16 (completions, as OpenAI).
    pub max_tokens: Option<u32>,
    pub stop: Vec<String>,
    pub seed: Option<u64>,
    pub logprobs: bool,
    /// Alternatives listed beside each token's log-prob (0 to [`MAX_ALTERNATIVES`]).
    pub top_logprobs: usize,
    pub stream: bool,
    pub include_usage: bool,
}

/// Most alternatives a request may ask for beside each token (OpenAI's and vLLM's bound).
pub const MAX_ALTERNATIVES: usize = 20;

/// Most stop strings a request may give.
const MAX_STOPS: usize = 16;

impl CallSampling {
    /// Takes the sampling fields common to both endpoints; `max_batch` bounds `n`.
    pub fn take(body: &mut Body, max_batch: usize) -> Result<Self, ApiError> {
        let n: u64 = body.take("n")?.unwrap_or(1);
        if n == 0 || n as usize > max_batch {
            return Err(ApiError::param(
                "invalid_value",
                "n",
                format!("`n` must be between 1 and the generator's --max-batch ({max_batch})"),
            ));
        }
        let temperature: Option<f32> = body.take("temperature")?;
        if temperature.is_some_and(|t| !(t.is_finite() && t >= 0.0)) {
            return Err(ApiError::param(
                "invalid_value",
                "temperature",
                "`temperature` must be a number >= 0",
            ));
        }
        let top_p: f32 = body.take("top_p")?.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::param(
                "invalid_value",
                "top_p",
                "`top_p` must be in (0, 1]",
            ));
        }
        // vLLM's convention: -1 (or 0) keeps every token.
        let top_k: i64 = body.take("top_k")?.unwrap_or(0);
        if top_k < -1 {
            return Err(ApiError::param(
                "invalid_value",
                "top_k",
                "`top_k` must be -1 or 0 (off), or a positive count",
            ));
        }
        let max_tokens: Option<u32> = match body.take("max_completion_tokens")? {
            Some(m) => {
                body.take_value("max_tokens");
                Some(m)
            }
            None => body.take("max_tokens")?,
        };
        if max_tokens == Some(0) {
            return Err(ApiError::param(
                "invalid_value",
                "max_tokens",
                "`max_tokens` must be at least 1",
            ));
        }
        let stop = take_stop(body)?;
        let seed: Option<i64> = body.take("seed")?;
        let stream: bool = body.take("stream")?.unwrap_or(false);
        let options: Option<Map<String, Value>> = body.take("stream_options")?;
        let include_usage = options
            .as_ref()
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        Ok(CallSampling {
            n: n as usize,
            temperature,
            top_p,
            top_k: top_k.max(0) as u32,
            max_tokens,
            stop,
            seed: seed.map(|s| s as u64),
            logprobs: false,
            top_logprobs: 0,
            stream,
            include_usage,
        })
    }
}

/// `stop`: one string or a list of them.
fn take_stop(body: &mut Body) -> Result<Vec<String>, ApiError> {
    let wrong = || {
        ApiError::param(
            "invalid_type",
            "stop",
            "`stop` must be a string or a list of strings",
        )
    };
    let stop: Vec<String> = match body.take_value("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(a)) => a
            .into_iter()
            .map(|v| match v {
                Value::String(s) => Ok(s),
                _ => Err(wrong()),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(wrong()),
    };
    if stop.len() > MAX_STOPS {
        return Err(ApiError::param(
            "invalid_value",
            "stop",
            format!("at most {MAX_STOPS} stop strings"),
        ));
    }
    Ok(stop)
}

/// What `/v1/completions` and `/v1/chat/completions` were asked, before tokenizing.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// A text prompt.
    Text(String),
    /// Token ids given as they are.
    Ids(Vec<u32>),
    /// Chat messages, with extra template variables (`tools`, `chat_template_kwargs`).
    Chat {
        messages: Vec<Value>,
        kwargs: Map<String, Value>,
    },
}

/// The one prompt of a `/v1/completions` body: a string, a list of ids, or a list holding
/// exactly one of those.
pub fn completion_input(body: &mut Body) -> Result<Input, ApiError> {
    let bad = |m: &str| ApiError::param("invalid_value", "prompt", m.to_string());
    let prompt = body
        .take_value("prompt")
        .ok_or_else(|| bad("`prompt` is required"))?;
    let one = match prompt {
        Value::Array(mut a) if a.len() == 1 && !a[0].is_number() => a.remove(0),
        Value::Array(a) if a.iter().all(|v| !v.is_number()) => {
            return Err(bad(
                "one prompt per request (use `n` for several completions of it)",
            ));
        }
        v => v,
    };
    match one {
        Value::String(s) => Ok(Input::Text(s)),
        Value::Array(a) => a
            .iter()
            .map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect::<Option<Vec<u32>>>()
            .map(Input::Ids)
            .ok_or_else(|| bad("`prompt` as token ids must be a list of non-negative integers")),
        _ => Err(bad("`prompt` must be a string or a list of token ids")),
    }
}

/// The messages of a `/v1/chat/completions` body, with content parts joined into text.
pub fn chat_input(body: &mut Body) -> Result<Input, ApiError> {
    let bad = |m: String| ApiError::param("invalid_value", "messages", m);
    let Some(Value::Array(messages)) = body.take_value("messages") else {
        return Err(bad("`messages` must be a non-empty list".into()));
    };
    if messages.is_empty() {
        return Err(bad("`messages` must be a non-empty list".into()));
    }
    let messages = messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            let Value::Object(mut m) = m else {
                return Err(bad(format!("message {i} is not an object")));
            };
            if !m.get("role").is_some_and(Value::is_string) {
                return Err(bad(format!("message {i} has no `role`")));
            }
            if let Some(Value::Array(parts)) = m.get("content") {
                let mut text = String::new();
                for p in parts {
                    match (p.get("type").and_then(Value::as_str), p.get("text")) {
                        (Some("text"), Some(Value::String(t))) => text.push_str(t),
                        _ => {
                            return Err(bad(format!(
                                "message {i}: only text content parts are supported"
                            )));
                        }
                    }
                }
                m.insert("content".into(), Value::String(text));
            }
            Ok(Value::Object(m))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut kwargs: Map<String, Value> = body.take("chat_template_kwargs")?.unwrap_or_default();
    if let Some(tools) = body.take_value("tools") {
        kwargs.insert("tools".into(), tools);
    }
    // Tools are only rendered into the prompt: a tool call is the model's text.
    if let Some(choice) = body.take_value("tool_choice")
        && choice != json!("auto")
        && choice != json!("none")
    {
        return Err(ApiError::param(
            "unsupported_parameter",
            "tool_choice",
            "`tool_choice` other than auto or none is not supported: tools are rendered into the prompt and calls come back as text",
        ));
    }
    Ok(Input::Chat { messages, kwargs })
}

/// What one choice carries besides OpenAI's fields.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChoiceTokens {
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub versions: Vec<u64>,
    /// Each token's alternatives (empty lists when none were asked for).
    pub alternatives: Vec<Vec<(u32, f32)>>,
}

impl ChoiceTokens {
    pub fn push(&mut self, token: u32, logprob: f32, version: u64, alternatives: Vec<(u32, f32)>) {
        self.token_ids.push(token);
        self.logprobs.push(logprob);
        self.versions.push(version);
        self.alternatives.push(alternatives);
    }

    /// The `rlstream` object of a choice (with the prompt's ids when given).
    pub fn json(&self, prompt: Option<&[u32]>) -> Value {
        let mut o = json!({
            "token_ids": self.token_ids,
            "logprobs": self.logprobs,
            "versions": self.versions,
        });
        if let Some(p) = prompt {
            o["prompt_token_ids"] = json!(p);
        }
        o
    }
}

/// Which endpoint a response is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    pub fn as_str(self) -> &'static str {
        match self {
            Endpoint::Completions => "completions",
            Endpoint::Chat => "chat",
        }
    }

    fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        }
    }
}

/// The parts of a response every choice and chunk shares.
#[derive(Debug, Clone)]
pub struct Head {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub endpoint: Endpoint,
}

impl Head {
    /// A response or chunk with `choices` (and `usage` when given).
    pub fn wrap(&self, chunk: bool, choices: Vec<Value>, usage: Option<Value>) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": self.endpoint.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v
    }
}

/// OpenAI's `usage`.
pub fn usage(prompt: usize, completion: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    })
}

/// OpenAI's `logprobs` of a choice for `tokens`, `texts` giving each id's text: the chat
/// form (`content`) or the completions form (`tokens`, `token_logprobs`, `top_logprobs`,
/// `text_offset` from `offset`). `listed`: whether alternatives were asked for (chat lists
/// `[]` and completions `null` when not).
pub fn logprobs_json(
    endpoint: Endpoint,
    tokens: &ChoiceTokens,
    texts: &dyn Fn(&[u32]) -> Vec<String>,
    offset: usize,
    listed: bool,
) -> Value {
    let own = texts(&tokens.token_ids);
    let alternatives = tokens.alternatives.iter().map(|alts| {
        let ids: Vec<u32> = alts.iter().map(|a| a.0).collect();
        texts(&ids).into_iter().zip(alts.iter().map(|a| a.1))
    });
    match endpoint {
        Endpoint::Chat => json!({"content": tokens
            .logprobs
            .iter()
            .zip(&own)
            .zip(alternatives)
            .map(|((lp, t), alts)| {
                let top: Vec<Value> = alts
                    .map(|(t, lp)| json!({"token": t, "logprob": lp, "bytes": t.as_bytes()}))
                    .collect();
                json!({"token": t, "logprob": lp, "bytes": t.as_bytes(), "top_logprobs": top})
            })
            .collect::<Vec<_>>()}),
        Endpoint::Completions => {
            let mut at = offset;
            let offsets: Vec<usize> = own
                .iter()
                .map(|t| {
                    let here = at;
                    at += t.len();
                    here
                })
                .collect();
            // One object per token, text to log-prob: of two ids with the same text, the
            // likelier is kept (as OpenAI's dictionary form must).
            let top = listed.then(|| {
                alternatives
                    .map(|alts| {
                        let mut m = Map::new();
                        for (t, lp) in alts {
                            m.entry(t).or_insert(json!(lp));
                        }
                        Value::Object(m)
                    })
                    .collect::<Vec<_>>()
            });
            json!({
                "tokens": own,
                "token_logprobs": tokens.logprobs,
                "top_logprobs": top,
                "text_offset": offsets,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: Value) -> Body {
        Body::parse(v.to_string().as_bytes()).expect("an object")
    }

    #[test]
    fn defaults_spelled_out_pass_and_anything_else_unknown_is_named() {
        let mut b = body(json!({
            "n": 2, "temperature": 0.7, "stop": "\n", "frequency_penalty": 0,
            "logit_bias": {}, "user": "u1", "stream": true,
            "stream_options": {"include_usage": true},
        }));
        let s = CallSampling::take(&mut b, 8).expect("valid");
        assert_eq!(
            (s.n, s.temperature, s.stop.clone()),
            (2, Some(0.7), vec!["\n".to_string()])
        );
        assert!(s.stream && s.include_usage);
        b.finish().expect("defaults and ignored fields pass");

        let mut b = body(json!({"presence_penalty": 0.5, "echo": true}));
        CallSampling::take(&mut b, 8).expect("valid");
        let e = b.finish().expect_err("a real penalty is refused");
        assert_eq!(
            (e.code, e.param.as_deref()),
            ("unsupported_parameter", Some("echo"))
        );

        for (field, value) in [
            ("n", json!(9)),
            ("top_p", json!(0)),
            ("temperature", json!(-1)),
        ] {
            let e = CallSampling::take(&mut body(json!({field: value})), 8).expect_err(field);
            assert_eq!(
                (e.status, e.param.as_deref()),
                (StatusCode::BAD_REQUEST, Some(field))
            );
        }
        let e = CallSampling::take(&mut body(json!({"max_tokens": "ten"})), 8).expect_err("type");
        assert_eq!(e.code, "invalid_type");
        assert_eq!(
            Body::parse(b"{not json").err().map(|e| e.code),
            Some("invalid_json")
        );
    }

    #[test]
    fn a_prompt_is_one_string_or_one_id_list() {
        let take = |v: Value| completion_input(&mut body(json!({"prompt": v})));
        assert_eq!(take(json!("hi")), Ok(Input::Text("hi".into())));
        assert_eq!(take(json!(["hi"])), Ok(Input::Text("hi".into())));
        assert_eq!(take(json!([1, 2])), Ok(Input::Ids(vec![1, 2])));
        assert_eq!(take(json!([[1, 2]])), Ok(Input::Ids(vec![1, 2])));
        assert!(take(json!(["a", "b"])).is_err());
        assert!(take(json!([1, -2])).is_err());
        let chat = chat_input(&mut body(json!({"messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ]})));
        match chat {
            Ok(Input::Chat { messages, .. }) => assert_eq!(messages[0]["content"], "ab"),
            other => panic!("{other:?}"),
        }
    }
}
