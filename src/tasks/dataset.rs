//! JSONL datasets: one `{"prompt": ..., "answer": ..., "verifier": ...}` object per line
//! (`verifier` optional: exact, numeric, contains, positional, math; default exact), or a
//! chat row with `"messages": [{"role": ..., "content": ...}, ...]` (OpenAI chat format) in
//! place of `prompt`, rendered with the policy's chat template (see [`Dataset::render`]),
//! optionally with `"chat_template_kwargs": {"enable_thinking": false}`. Extra string fields
//! are carried to the scorer in the message meta.

use super::{ANSWER, TaskItem, VERIFIER, Verifier};
use std::collections::BTreeMap;
use std::path::Path;

#[derive(Debug, Clone, PartialEq)]
pub struct DatasetItem {
    /// 1-based line number, for ids and errors.
    pub line: usize,
    /// The prompt; a chat row's is empty until [`Dataset::render`].
    pub item: TaskItem,
    /// A chat row's conversation and template arguments.
    pub chat: Option<Chat>,
}

/// A chat row: the conversation up to the turn the policy answers.
#[derive(Debug, Clone, PartialEq)]
pub struct Chat {
    pub messages: Vec<serde_json::Value>,
    pub kwargs: serde_json::Map<String, serde_json::Value>,
}

#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    #[error("cannot read dataset {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}: {reason}")]
    Line {
        path: String,
        line: usize,
        reason: String,
    },
    #[error("{path}: no items")]
    Empty { path: String },
}

#[derive(Debug, Clone)]
pub struct Dataset {
    /// File stem, used as the task name.
    pub name: String,
    pub items: Vec<DatasetItem>,
}

/// A `messages` array of `{"role": string, "content": string}` objects, ending with a turn
/// for the policy to answer, and the template arguments.
fn chat(messages: &serde_json::Value, kwargs: Option<&serde_json::Value>) -> Result<Chat, String> {
    let list = messages
        .as_array()
        .filter(|m| !m.is_empty())
        .ok_or("`messages` must be a non-empty list of {\"role\", \"content\"} objects")?;
    for (i, m) in list.iter().enumerate() {
        let text = |k: &str| m.get(k).and_then(serde_json::Value::as_str);
        if text("role").is_none() || text("content").is_none() {
            return Err(format!(
                "messages[{i}] needs a string `role` and a string `content`"
            ));
        }
    }
    if list
        .last()
        .and_then(|m| m.get("role"))
        .and_then(|r| r.as_str())
        == Some("assistant")
    {
        return Err("the last message is the assistant's: nothing is left to answer".into());
    }
    let kwargs = match kwargs {
        None => serde_json::Map::new(),
        Some(serde_json::Value::Object(o)) => o.clone(),
        Some(_) => return Err("`chat_template_kwargs` must be an object".into()),
    };
    Ok(Chat {
        messages: list.clone(),
        kwargs,
    })
}

impl Dataset {
    /// Whether any row is a chat row (needs [`Dataset::render`]).
    pub fn has_chat(&self) -> bool {
        self.items.iter().any(|i| i.chat.is_some())
    }

    /// Renders each chat row's conversation with `template`, with the assistant's opening,
    /// as its prompt text.
    pub fn render(&mut self, template: &crate::model::chat::ChatTemplate) -> Result<(), String> {
        for it in &mut self.items {
            if let Some(chat) = &it.chat {
                it.item.prompt = template
                    .render(&chat.messages, true, &chat.kwargs)
                    .map_err(|e| format!("line {}: {e}", it.line))?;
            }
        }
        Ok(())
    }

    pub fn load(path: &Path) -> Result<Self, DatasetError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| DatasetError::Io {
            path: p.clone(),
            source,
        })?;
        let mut items = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            if raw.trim().is_empty() {
                continue;
            }
            let bad = |reason: String| DatasetError::Line {
                path: p.clone(),
                line,
                reason,
            };
            let v: serde_json::Value =
                serde_json::from_str(raw).map_err(|e| bad(format!("not JSON: {e}")))?;
            let obj = v
                .as_object()
                .ok_or_else(|| bad("not a JSON object".into()))?;
            let field = |k: &str| -> Result<String, DatasetError> {
                match obj.get(k) {
                    Some(serde_json::Value::String(s)) => Ok(s.clone()),
                    Some(serde_json::Value::Number(n)) => Ok(n.to_string()),
                    Some(_) => Err(bad(format!("`{k}` must be a string or number"))),
                    None => Err(bad(format!("missing `{k}`"))),
                }
            };
            let answer = field(ANSWER)?;
            let (prompt, chat) = match (obj.get("prompt"), obj.get("messages")) {
                (Some(_), Some(_)) => {
                    return Err(bad("give `prompt` or `messages`, not both".into()));
                }
                (None, Some(m)) => (
                    String::new(),
                    Some(chat(m, obj.get("chat_template_kwargs")).map_err(bad)?),
                ),
                _ => (field("prompt")?, None),
            };
            let verifier = match obj.get(VERIFIER) {
                None => Verifier::Exact,
                Some(serde_json::Value::String(s)) => Verifier::from_name(s).ok_or_else(|| {
                    bad(format!(
                        "unknown verifier `{s}` (one of: {})",
                        Verifier::ALL.map(Verifier::name).join(", ")
                    ))
                })?,
                Some(_) => return Err(bad("`verifier` must be a string".into())),
            };
            let mut meta = BTreeMap::new();
            for (k, v) in obj {
                if let serde_json::Value::String(s) = v
                    && k != "prompt"
                {
                    meta.insert(k.clone(), s.clone());
                }
            }
            meta.insert(ANSWER.to_string(), answer.clone());
            meta.insert(VERIFIER.to_string(), verifier.name().to_string());
            items.push(DatasetItem {
                line,
                item: TaskItem {
                    prompt,
                    answer,
                    meta,
                },
                chat,
            });
        }
        if items.is_empty() {
            return Err(DatasetError::Empty { path: p });
        }
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "dataset".into());
        Ok(Dataset { name, items })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_items_and_names_bad_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("math.jsonl");
        std::fs::write(
            &path,
            "{\"prompt\": \"2+2=\", \"answer\": 4, \"verifier\": \"numeric\"}\n\n{\"prompt\": \"hi\", \"answer\": \"hello\", \"source\": \"x\"}\n",
        )
        .unwrap();
        let d = Dataset::load(&path).unwrap();
        assert_eq!(d.name, "math");
        assert_eq!(d.items.len(), 2);
        assert_eq!(d.items[0].item.meta["verifier"], "numeric");
        assert_eq!(d.items[1].line, 3);
        assert_eq!(d.items[1].item.meta["source"], "x");
        std::fs::write(&path, "{\"prompt\": \"a\"}\n").unwrap();
        let e = Dataset::load(&path).unwrap_err().to_string();
        assert!(e.ends_with("math.jsonl:1: missing `answer`"), "{e}");
        std::fs::write(
            &path,
            "{\"prompt\": \"a\", \"answer\": \"b\", \"verifier\": \"fuzzy\"}\n",
        )
        .unwrap();
        assert!(
            Dataset::load(&path)
                .unwrap_err()
                .to_string()
                .contains("unknown verifier `fuzzy`")
        );
    }
}
