//! Chat templates: a model's own `chat_template` from `tokenizer_config.json`, rendered the
//! way `transformers`' `apply_chat_template` renders it (Jinja with `trim_blocks` and
//! `lstrip_blocks`, Python's string methods, `raise_exception`, `strftime_now`), so the
//! prompt a policy is trained on is the one it will be served with.

use super::ModelError;
use minijinja::{Environment, ErrorKind, Value};
use serde_json::{Map, Value as Json};
use std::path::Path;

/// The file holding the template and the special tokens it refers to.
pub const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
/// The template file transformers' `save_pretrained` writes (since 4.43).
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// A model's chat template, ready to render.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

/// A special token field: a string, `null`, or an `AddedToken` object with `content`.
fn token_text(v: Option<&Json>) -> String {
    match v {
        Some(Json::String(s)) => s.clone(),
        Some(Json::Object(o)) => o
            .get("content")
            .and_then(Json::as_str)
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

fn template_error(e: minijinja::Error) -> ModelError {
    // The template's own `raise_exception` message comes first: it says what is wrong with
    // the conversation.
    let mut text = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    ModelError::Tokenizer(format!("chat template: {text}"))
}

/// `strftime_now(format)`: the current UTC time in a C `strftime` format (the directives
/// chat templates use: `%d %b %B %m %Y %y %H %M %S %j %%`).
fn strftime_now(format: &str) -> Result<String, minijinja::Error> {
    let now = time::OffsetDateTime::now_utc();
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let d = chars.next().unwrap_or('%');
        let month = now.month();
        match d {
            'd' => out.push_str(&format!("{:02}", now.day())),
            'b' => out.push_str(&month.to_string()[..3]),
            'B' => out.push_str(&month.to_string()),
            'm' => out.push_str(&format!("{:02}", u8::from(month))),
            'Y' => out.push_str(&now.year().to_string()),
            'y' => out.push_str(&format!("{:02}", now.year().rem_euclid(100))),
            'H' => out.push_str(&format!("{:02}", now.hour())),
            'M' => out.push_str(&format!("{:02}", now.minute())),
            'S' => out.push_str(&format!("{:02}", now.second())),
            'j' => out.push_str(&format!("{:03}", now.ordinal())),
            '%' => out.push('%'),
            other => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: unsupported directive %{other}"),
                ));
            }
        }
    }
    Ok(out)
}

impl ChatTemplate {
    /// The template of a model directory: `chat_template.jinja` where there is one (as
    /// transformers' `save_pretrained` writes it since 4.43, and as transformers reads it,
    /// before `tokenizer_config.json`'s), else `tokenizer_config.json`'s `chat_template`;
    /// the special tokens from `tokenizer_config.json`. `None` when neither holds a template
    /// (a base model).
    pub fn load(dir: &Path) -> Result<Option<Self>, ModelError> {
        let dir = &super::model_dir(dir);
        let read = |path: &Path| {
            std::fs::read_to_string(path).map_err(|source| ModelError::Io {
                path: path.display().to_string(),
                source,
            })
        };
        let path = dir.join(TOKENIZER_CONFIG);
        let jinja = dir.join(CHAT_TEMPLATE_FILE);
        let config = if path.exists() {
            read(&path)?
        } else {
            "{}".to_string()
        };
        let (source, origin) = if jinja.exists() {
            (Some(read(&jinja)?), &jinja)
        } else if path.exists() {
            (None, &path)
        } else {
            return Ok(None);
        };
        Self::from_parts(&config, source)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", origin.display())))
    }

    /// The template of a `tokenizer_config.json` text; `None` without a `chat_template`.
    /// A list of named templates (`[{"name": "default", "template": ...}]`) uses `default`.
    pub fn from_config_json(text: &str) -> Result<Option<Self>, ModelError> {
        Self::from_parts(text, None)
    }

    /// The template `source` (or, without one, the config's `chat_template`) with the
    /// special tokens of the `tokenizer_config.json` text `config`.
    fn from_parts(config: &str, source: Option<String>) -> Result<Option<Self>, ModelError> {
        let cfg: Map<String, Json> = serde_json::from_str(config)
            .map_err(|e| ModelError::Tokenizer(format!("not a JSON object: {e}")))?;
        let source = match source {
            Some(s) => s,
            None => match Self::config_source(&cfg)? {
                Some(s) => s,
                None => return Ok(None),
            },
        };
        let mut env = Environment::new();
        // transformers renders with jinja2's trim_blocks and lstrip_blocks.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> Result<Value, _> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
        });
        env.add_function("strftime_now", |format: String| strftime_now(&format));
        env.add_template_owned("chat", source)
            .map_err(template_error)?;
        Ok(Some(ChatTemplate {
            env,
            bos_token: token_text(cfg.get("bos_token")),
            eos_token: token_text(cfg.get("eos_token")),
        }))
    }

    /// `tokenizer_config.json`'s `chat_template`, if it has one.
    fn config_source(cfg: &Map<String, Json>) -> Result<Option<String>, ModelError> {
        Ok(Some(match cfg.get("chat_template") {
            None | Some(Json::Null) => return Ok(None),
            Some(Json::String(s)) => s.clone(),
            Some(Json::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(Json::as_str)
                .ok_or_else(|| {
                    ModelError::Tokenizer("chat_template lists no `default` template".into())
                })?
                .to_string(),
            Some(_) => {
                return Err(ModelError::Tokenizer(
                    "chat_template must be a string or a list of named templates".into(),
                ));
            }
        }))
    }

    /// Renders `messages` (OpenAI chat format: `{"role", "content", ...}`), with the
    /// assistant's opening when `add_generation_prompt`, and `kwargs` as extra template
    /// variables (`enable_thinking`, `date_string`, `tools`).
    pub fn render(
        &self,
        messages: &[Json],
        add_generation_prompt: bool,
        kwargs: &Map<String, Json>,
    ) -> Result<String, ModelError> {
        let mut ctx = kwargs.clone();
        ctx.insert("messages".into(), Json::Array(messages.to_vec()));
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(add_generation_prompt),
        );
        ctx.insert("bos_token".into(), Json::String(self.bos_token.clone()));
        ctx.insert("eos_token".into(), Json::String(self.eos_token.clone()));
        let template = self.env.get_template("chat").map_err(template_error)?;
        template
            .render(Value::from_serialize(&ctx))
            .map_err(template_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(source: &str) -> ChatTemplate {
        let cfg = serde_json::json!({
            "chat_template": source,
            "bos_token": {"content": "<s>", "lstrip": false},
            "eos_token": "</s>",
        });
        ChatTemplate::from_config_json(&cfg.to_string())
            .unwrap()
            .unwrap()
    }

    #[test]
    fn python_string_methods_special_tokens_and_raise_exception_work() {
        let t = template(
            "{{ bos_token }}{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}\
             {{ raise_exception('bad role ' + m.role) }}{% endif %}\
             [{{ m.role }}]{{ m.content.strip().split(' ')[-1] }}{% endfor %}\
             {% if add_generation_prompt %}[assistant]{% endif %}{{ eos_token }}",
        );
        let msgs = [serde_json::json!({"role": "user", "content": "  say hi  "})];
        assert_eq!(
            t.render(&msgs, true, &Map::new()).unwrap(),
            "<s>[user]hi[assistant]</s>"
        );
        let bad = [serde_json::json!({"role": "robot", "content": "x"})];
        let e = t.render(&bad, false, &Map::new()).unwrap_err().to_string();
        assert!(e.contains("bad role robot"), "{e}");
        let today = t
            .env
            .render_str("{{ strftime_now('%d %b %Y') }}", ())
            .unwrap();
        assert_eq!(today.len(), 11, "{today}");
    }

    #[test]
    fn configs_without_a_template_or_with_a_broken_one_are_told_apart() {
        assert!(ChatTemplate::from_config_json("{}").unwrap().is_none());
        let broken = serde_json::json!({"chat_template": "{% for m in messages %}"});
        let e = ChatTemplate::from_config_json(&broken.to_string()).unwrap_err();
        assert!(e.to_string().contains("chat template"), "{e}");
        let named = serde_json::json!({"chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "plain"},
        ]});
        let t = ChatTemplate::from_config_json(&named.to_string())
            .unwrap()
            .unwrap();
        assert_eq!(t.render(&[], false, &Map::new()).unwrap(), "plain");
    }
}
