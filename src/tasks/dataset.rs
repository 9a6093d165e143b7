//! Datasets: JSONL files and Parquet files (as dataset hubs serve them).
//!
//! A JSONL file holds one `{"prompt": ..., "answer": ..., "verifier": ...}` object per line
//! (`verifier` optional: exact, numeric, contains, positional, math; default exact), or a
//! chat row with `"messages": [{"role": ..., "content": ...}, ...]` (OpenAI chat format) in
//! place of `prompt`, rendered with the policy's chat template (see [`Dataset::render`]),
//! optionally with `"chat_template_kwargs": {"enable_thinking": false}`. Extra string fields
//! are carried to the scorer in the message meta. A bad line stops the load with its number.
//!
//! A Parquet file (told by its `PAR1` magic, whatever its name) holds the same fields as
//! columns: a text prompt column or a `messages` column (a list of `{role, content}`
//! structs), an answer column (text or a number), optionally `verifier`; every other text
//! column goes to the meta. [`Columns`] names the prompt, answer and messages columns (the
//! `--prompt-column`, `--answer-column`, `--messages-column` flags; they rename JSONL
//! fields too). A missing column stops the load with the columns the file has; a bad row (a
//! null, a wrong type, an empty prompt, an unanswerable conversation) is counted, skipped
//! and reported with its 0-based row number ([`Dataset::skipped`]), never fed.

use super::item::{ANSWER, TaskItem, VERIFIER};
use super::verify::Verifier;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::path::Path;

mod parquet_file;

#[derive(Debug, Clone, PartialEq)]
pub struct DatasetItem {
    /// A JSONL item's 1-based line number, a Parquet item's 0-based row number: for ids and
    /// errors ([`Dataset::at`]).
    pub line: usize,
    /// The prompt; a chat row's is empty until [`Dataset::render`].
    pub item: TaskItem,
    /// A chat row's conversation and template arguments.
    pub chat: Option<Chat>,
}

/// A chat row: the conversation up to the turn the policy answers.
#[derive(Debug, Clone, PartialEq)]
pub struct Chat {
    pub messages: Vec<Value>,
    pub kwargs: Map<String, Value>,
}

/// The names of a dataset's prompt, answer and messages fields (JSONL) or columns (Parquet).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Columns {
    pub prompt: String,
    pub answer: String,
    pub messages: String,
}

impl Default for Columns {
    fn default() -> Self {
        Columns {
            prompt: "prompt".into(),
            answer: ANSWER.into(),
            messages: "messages".into(),
        }
    }
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
    /// A Parquet file that cannot be read, or lacks a column.
    #[error("{path}: {reason}")]
    File { path: String, reason: String },
    #[error("{path}: no items{}", .why.as_deref().map(|w| format!(" ({w})")).unwrap_or_default())]
    Empty { path: String, why: Option<String> },
}

/// How a dataset numbers its items.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// JSONL: 1-based lines.
    Line,
    /// Parquet: 0-based rows, as pandas and the hubs' dataset viewers count them.
    Row,
}

impl Unit {
    /// What an item number counts: "line" or "row".
    pub fn name(self) -> &'static str {
        match self {
            Unit::Line => "line",
            Unit::Row => "row",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Dataset {
    /// File stem, used as the task name.
    pub name: String,
    pub items: Vec<DatasetItem>,
    /// How [`DatasetItem::line`] counts.
    pub unit: Unit,
    /// Rows read, good and bad.
    pub rows: usize,
    /// The bad rows skipped (Parquet): row number and why.
    pub skipped: Vec<(usize, String)>,
}

/// A `messages` array of `{"role": string, "content": string}` objects, ending with a turn
/// for the policy to answer, and the template arguments.
fn chat(messages: &Value, kwargs: Option<&Value>) -> Result<Chat, String> {
    let list = messages
        .as_array()
        .filter(|m| !m.is_empty())
        .ok_or("`messages` must be a non-empty list of {\"role\", \"content\"} objects")?;
    for (i, m) in list.iter().enumerate() {
        let text = |k: &str| m.get(k).and_then(Value::as_str);
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
        None => Map::new(),
        Some(Value::Object(o)) => o.clone(),
        Some(_) => return Err("`chat_template_kwargs` must be an object".into()),
    };
    Ok(Chat {
        messages: list.clone(),
        kwargs,
    })
}

/// One row (a JSONL object, a Parquet row as JSON) as an item, or why it cannot be one.
fn row_item(obj: &Map<String, Value>, cols: &Columns) -> Result<(TaskItem, Option<Chat>), String> {
    let field = |k: &str| -> Result<String, String> {
        match obj.get(k) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(Value::Number(n)) => Ok(n.to_string()),
            Some(Value::Null) => Err(format!("`{k}` is null")),
            Some(_) => Err(format!("`{k}` must be a string or number")),
            None => Err(format!("missing `{k}`")),
        }
    };
    let answer = field(&cols.answer)?;
    let (prompt, chat) = match (obj.get(&cols.prompt), obj.get(&cols.messages)) {
        (Some(_), Some(_)) => {
            return Err(format!(
                "give `{}` or `{}`, not both",
                cols.prompt, cols.messages
            ));
        }
        (None, Some(Value::Null)) => return Err(format!("`{}` is null", cols.messages)),
        (None, Some(m)) => (
            String::new(),
            Some(chat(m, obj.get("chat_template_kwargs"))?),
        ),
        _ => (field(&cols.prompt)?, None),
    };
    if chat.is_none() && prompt.trim().is_empty() {
        return Err("empty prompt".into());
    }
    let verifier = match obj.get(VERIFIER) {
        None | Some(Value::Null) => Verifier::Exact,
        Some(Value::String(s)) => Verifier::from_name(s).ok_or_else(|| {
            format!(
                "unknown verifier `{s}` (one of: {})",
                Verifier::ALL.map(Verifier::name).join(", ")
            )
        })?,
        Some(_) => return Err("`verifier` must be a string".into()),
    };
    let mut meta = BTreeMap::new();
    for (k, v) in obj {
        if let Value::String(s) = v
            && *k != cols.prompt
        {
            meta.insert(k.clone(), s.clone());
        }
    }
    meta.insert(ANSWER.to_string(), answer.clone());
    meta.insert(VERIFIER.to_string(), verifier.name().to_string());
    Ok((
        TaskItem {
            prompt,
            answer,
            meta,
        },
        chat,
    ))
}

impl DatasetItem {
    /// What the held-out split hashes: the prompt, or a chat row's conversation as JSON
    /// (before the template renders it, so the split does not depend on the model).
    pub fn split_key(&self) -> String {
        match &self.chat {
            Some(chat) => Value::Array(chat.messages.clone()).to_string(),
            None => self.item.prompt.clone(),
        }
    }
}

/// Whether a dataset row whose prompt (or conversation) is `key` falls in a held-out share
/// `share` (0 to 1) of its file: a stable hash of `key` alone, as the built-in tasks hold
/// out theirs, so the split is the same for every seed and run and the file's order does
/// not matter.
pub fn held_out_share(key: &str, share: f64) -> bool {
    let h = crate::seed::mix(crate::seed::fnv1a(key.as_bytes())) >> 11;
    (h as f64) < share * (1u64 << 53) as f64
}

/// At most this many skipped rows are listed by [`Dataset::skipped_report`].
const LISTED: usize = 5;

impl Dataset {
    /// Whether any row is a chat row (needs [`Dataset::render`]).
    pub fn has_chat(&self) -> bool {
        self.items.iter().any(|i| i.chat.is_some())
    }

    /// "line 3" or "row 2": where item number `n` is.
    pub fn at(&self, n: usize) -> String {
        format!("{} {n}", self.unit.name())
    }

    /// The id of `item` in pass `epoch`: `NAME-eEPOCH-lLINE` or `NAME-eEPOCH-rROW`.
    pub fn item_id(&self, epoch: u32, item: &DatasetItem) -> String {
        let u = &self.unit.name()[..1];
        format!("{}-e{epoch}-{u}{}", self.name, item.line)
    }

    /// The bad rows skipped, in one line: how many, and the first few with their reasons.
    pub fn skipped_report(&self) -> Option<String> {
        if self.skipped.is_empty() {
            return None;
        }
        let listed: Vec<String> = self
            .skipped
            .iter()
            .take(LISTED)
            .map(|(n, why)| format!("{}: {why}", self.at(*n)))
            .collect();
        let more = self.skipped.len().saturating_sub(LISTED);
        Some(format!(
            "skipped {} bad rows of {} (never fed): {}{}",
            self.skipped.len(),
            self.rows,
            listed.join("; "),
            if more > 0 {
                format!("; and {more} more")
            } else {
                String::new()
            }
        ))
    }

    /// Renders each chat row's conversation with `template`, with the assistant's opening,
    /// as its prompt text.
    pub fn render(&mut self, template: &crate::model::chat::ChatTemplate) -> Result<(), String> {
        let unit = self.unit;
        for it in &mut self.items {
            if let Some(chat) = &it.chat {
                it.item.prompt = template
                    .render(&chat.messages, true, &chat.kwargs)
                    .map_err(|e| format!("{} {}: {e}", unit.name(), it.line))?;
            }
        }
        Ok(())
    }

    /// Splits off the held-out rows ([`held_out_share`] of `share`): the training
    /// rows, then the held-out rows, each in file order.
    pub fn split(self, share: f64) -> (Dataset, Dataset) {
        let (held, train): (Vec<DatasetItem>, Vec<DatasetItem>) = self
            .items
            .into_iter()
            .partition(|it| held_out_share(&it.split_key(), share));
        let part = |items| Dataset {
            name: self.name.clone(),
            items,
            unit: self.unit,
            rows: self.rows,
            skipped: self.skipped.clone(),
        };
        (part(train), part(held))
    }

    /// [`Dataset::load_with`], the bad rows it skipped reported as a warning (never fed).
    pub fn load_reported(path: &Path, cols: &Columns) -> Result<Self, DatasetError> {
        let d = Self::load_with(path, cols)?;
        if let Some(report) = d.skipped_report() {
            tracing::warn!("{}: {report}", path.display());
        }
        Ok(d)
    }

    /// Loads a JSONL or Parquet file (told by its contents) with the default column names.
    pub fn load(path: &Path) -> Result<Self, DatasetError> {
        Self::load_with(path, &Columns::default())
    }

    /// Loads a JSONL or Parquet file (told by its contents), with `cols` naming the prompt,
    /// answer and messages fields.
    pub fn load_with(path: &Path, cols: &Columns) -> Result<Self, DatasetError> {
        let p = path.display().to_string();
        let io = |source| DatasetError::Io {
            path: p.clone(),
            source,
        };
        let bytes = std::fs::read(path).map_err(io)?;
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "dataset".into());
        let d = if bytes.starts_with(parquet_file::MAGIC) {
            parquet_file::load(bytes.into(), &p, name, cols)?
        } else {
            let text = String::from_utf8(bytes).map_err(|e| {
                io(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("neither Parquet nor UTF-8 JSONL ({e})"),
                ))
            })?;
            Self::jsonl(&text, &p, name, cols)?
        };
        if d.items.is_empty() {
            return Err(DatasetError::Empty {
                why: d.skipped_report(),
                path: p,
            });
        }
        Ok(d)
    }

    fn jsonl(text: &str, p: &str, name: String, cols: &Columns) -> Result<Self, DatasetError> {
        let mut items = Vec::new();
        let mut rows = 0;
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            if raw.trim().is_empty() {
                continue;
            }
            rows += 1;
            let bad = |reason: String| DatasetError::Line {
                path: p.to_string(),
                line,
                reason,
            };
            let v: Value = serde_json::from_str(raw).map_err(|e| bad(format!("not JSON: {e}")))?;
            let obj = v
                .as_object()
                .ok_or_else(|| bad("not a JSON object".into()))?;
            let (item, chat) = row_item(obj, cols).map_err(bad)?;
            items.push(DatasetItem { line, item, chat });
        }
        Ok(Dataset {
            name,
            items,
            unit: Unit::Line,
            rows,
            skipped: Vec::new(),
        })
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

    fn fixture(name: &str) -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/datasets")
            .join(name)
    }

    /// What pyarrow wrote (scripts/make_parquet_fixtures.py): every good row read as it
    /// wrote it, every bad row skipped with its row number and reason.
    #[test]
    fn parquet_files_read_as_pyarrow_wrote_them() {
        let expected: Value =
            serde_json::from_str(&std::fs::read_to_string(fixture("expected.json")).unwrap())
                .unwrap();
        let question = Columns {
            prompt: "question".into(),
            ..Columns::default()
        };
        for (file, cols) in [
            ("gsm8k_style.parquet", &question),
            ("chat_rows.parquet", &Columns::default()),
        ] {
            let want = &expected[file];
            let d = Dataset::load_with(&fixture(file), cols).unwrap();
            assert_eq!(d.unit, Unit::Row);
            assert_eq!(d.rows as u64, want["rows"].as_u64().unwrap(), "{file}");
            let skipped: Vec<(String, String)> = want["skipped"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
                .collect();
            let got: Vec<(String, String)> = d
                .skipped
                .iter()
                .map(|(n, why)| (n.to_string(), why.clone()))
                .collect();
            assert_eq!(got, skipped, "{file}");
            let items = want["items"].as_array().unwrap();
            assert_eq!(d.items.len(), items.len(), "{file}");
            for (it, w) in d.items.iter().zip(items) {
                assert_eq!(it.line as u64, w["row"].as_u64().unwrap());
                assert_eq!(it.item.answer, w["answer"].as_str().unwrap());
                assert_eq!(it.item.meta[ANSWER], it.item.answer);
                match &it.chat {
                    Some(chat) => {
                        assert_eq!(&Value::Array(chat.messages.clone()), &w["messages"]);
                        assert_eq!(it.item.meta[VERIFIER], "numeric");
                    }
                    None => {
                        assert_eq!(it.item.prompt, w["prompt"].as_str().unwrap());
                        // Text columns reach the scorer; numbers and the prompt do not.
                        assert_eq!(it.item.meta["source"], w["source"].as_str().unwrap());
                        assert!(!it.item.meta.contains_key("difficulty"));
                        assert!(!it.item.meta.contains_key("question"));
                        assert_eq!(it.item.meta[VERIFIER], "exact");
                    }
                }
            }
        }
        let d = Dataset::load_with(&fixture("gsm8k_style.parquet"), &question).unwrap();
        assert_eq!(
            d.skipped_report().unwrap(),
            "skipped 2 bad rows of 6 (never fed): row 2: empty prompt; row 4: `answer` is null"
        );
        assert_eq!(d.item_id(1, &d.items[0]), "gsm8k_style-e1-r0");
    }

    #[test]
    fn parquet_files_without_a_usable_row_or_column_are_refused_with_what_to_do() {
        let e = Dataset::load(&fixture("gsm8k_style.parquet"))
            .unwrap_err()
            .to_string();
        assert!(
            e.ends_with(
                "no `prompt` or `messages` column (its columns: question, answer, source, \
                 difficulty): name the prompt column with --prompt-column or the conversation \
                 column with --messages-column"
            ),
            "{e}"
        );
        let cols = Columns {
            prompt: "question".into(),
            answer: "solution".into(),
            ..Columns::default()
        };
        let e = Dataset::load_with(&fixture("gsm8k_style.parquet"), &cols)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no `solution` column"), "{e}");
        assert!(
            e.ends_with("name the answer column with --answer-column"),
            "{e}"
        );
        // Every row wrongly typed: nothing to feed, and why, row by row.
        let e = Dataset::load(&fixture("wrong_types.parquet"))
            .unwrap_err()
            .to_string();
        assert!(
            e.ends_with(
                "no items (skipped 2 bad rows of 2 (never fed): row 0: `prompt` must be a \
                 string or number; row 1: `prompt` must be a string or number)"
            ),
            "{e}"
        );
        // A codec this build does not read: what to do instead.
        let e = Dataset::load(&fixture("brotli.parquet"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("brotli") && e.contains("rewrite the file with one of those"),
            "{e}"
        );
        // A file cut short is not Parquet any more.
        let dir = tempfile::tempdir().unwrap();
        let cut = dir.path().join("cut.parquet");
        let bytes = std::fs::read(fixture("chat_rows.parquet")).unwrap();
        std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
        let e = Dataset::load(&cut).unwrap_err().to_string();
        assert!(e.contains("not a readable Parquet file"), "{e}");
    }

    #[test]
    fn jsonl_fields_are_renamed_by_the_column_names() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("q.jsonl");
        std::fs::write(
            &path,
            "{\"question\": \"2+2=\", \"solution\": \"4\"}\n{\"question\": \" \", \"solution\": \"1\"}\n",
        )
        .unwrap();
        let cols = Columns {
            prompt: "question".into(),
            answer: "solution".into(),
            ..Columns::default()
        };
        let e = Dataset::load_with(&path, &cols).unwrap_err().to_string();
        assert!(e.ends_with("q.jsonl:2: empty prompt"), "{e}");
        std::fs::write(&path, "{\"question\": \"2+2=\", \"solution\": 4}\n").unwrap();
        let d = Dataset::load_with(&path, &cols).unwrap();
        assert_eq!(d.items[0].item.prompt, "2+2=");
        assert_eq!(d.items[0].item.answer, "4");
        assert_eq!(d.item_id(0, &d.items[0]), "q-e0-l1");
    }
}
