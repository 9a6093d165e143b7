//! How `replay` prints an entry: a JSON line, a table line, or prompts and completions as
//! text with each token's policy version and log-prob (and rewards and teacher log-probs
//! where they were placed on tokens).

use super::message::{EntryMessage, mean, time_of};
use crate::bus::EntryId;
use crate::model::tokenizer::Tokenizer;
use crate::schema::json::msgpack_to_json;
use crate::schema::{Floats, RolloutGroup, Sample, ScoredGroup};
use serde_json::{Value as Json, json};
use std::fmt::Write as _;

pub(super) fn json_line(stream: &str, id: EntryId, payload: &[u8], m: &EntryMessage) -> Json {
    let message = msgpack_to_json(payload).unwrap_or_else(|e| json!({ "undecodable": e }));
    let mut line = json!({
        "stream": stream,
        "id": id.to_string(),
        "time": time_of(id),
        "message": message,
    });
    if let EntryMessage::Dead(d) = m {
        // The original bytes, decoded where they still decode, and always as hex.
        line["original"] = msgpack_to_json(&d.payload).unwrap_or(Json::Null);
        line["original_hex"] = Json::String(d.payload.iter().map(|b| format!("{b:02x}")).collect());
    }
    if let EntryMessage::Undecodable(e) = m {
        line["error"] = Json::String(e.clone());
    }
    line
}

pub(super) fn table_line(id: EntryId, m: &EntryMessage) -> String {
    let head = format!("{id:<20} {}", time_of(id));
    let body = match m {
        EntryMessage::Prompt(p) => format!("prompt {} task {} {:?}", p.prompt_id, p.task, p.text),
        EntryMessage::Rollout(g) => rollout_summary(g),
        EntryMessage::Scored(s) => format!(
            "{}  reward mean {:.3} [{}]",
            rollout_summary(&s.rollout),
            mean(&s.rewards),
            s.rewards
                .iter()
                .map(|r| format!("{r:.2}"))
                .collect::<Vec<_>>()
                .join(" ")
        ),
        EntryMessage::Weights(a) => format!(
            "weights v{} step {} {} {} bytes in {} chunks, checksum {}",
            a.version, a.step, a.format, a.bytes, a.chunks, a.checksum
        ),
        EntryMessage::Dead(d) => format!(
            "dead letter from {} {} (group {}, consumer {}, {} deliveries): {}: {} [{} bytes]",
            d.source_stream,
            d.source_id,
            d.group,
            d.consumer,
            d.deliveries,
            d.reason,
            d.error,
            d.payload.len()
        ),
        EntryMessage::Event(e) => {
            let fields: Vec<String> = e
                .fields
                .iter()
                .map(|(k, v)| format!("{k}={}", number(*v)))
                .collect();
            format!(
                "{} {} {} v{} {}",
                e.kind,
                e.stage,
                e.source,
                e.version,
                fields.join(" ")
            )
        }
        EntryMessage::Undecodable(err) => format!("undecodable: {err}"),
    };
    format!("{head}  {body}")
}

pub(super) fn rollout_summary(g: &RolloutGroup) -> String {
    let versions: std::collections::BTreeSet<u64> = g
        .samples
        .iter()
        .flat_map(|s| s.versions.iter().map(|v| v.version))
        .collect();
    format!(
        "group {} task {} {} samples {} tokens versions {:?} by {}",
        g.group_id,
        g.task,
        g.samples.len(),
        g.completion_tokens(),
        versions,
        g.gen_id
    )
}

/// Tokens `range` of `s` (the model's), each as `"piece"(vVERSION LOGPROB)`, with
/// `r±REWARD` where a reward sits on it and `tTEACHER` where a teacher scored it.
pub(super) fn tokens_line(
    s: &Sample,
    range: std::ops::Range<usize>,
    tok: &Tokenizer,
    token_rewards: Option<&[f32]>,
    teacher: Option<&[f32]>,
) -> String {
    let mut o = String::new();
    for (i, (&t, &lp)) in s
        .tokens
        .iter()
        .zip(s.logprobs.iter())
        .enumerate()
        .take(range.end)
        .skip(range.start)
    {
        // Tokens without text (end of sequence, special tokens) show as their id.
        let piece = tok
            .decode(&[t])
            .ok()
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| format!("<{t}>"));
        let _ = write!(o, "{piece:?}(v{} {lp:.2}", s.version_at(i));
        if let Some(&r) = token_rewards.and_then(|r| r.get(i))
            && r != 0.0
        {
            let _ = write!(o, " r{r:+.3}");
        }
        if let Some(&t) = teacher.and_then(|t| t.get(i)) {
            let _ = write!(o, " t{t:.2}");
        }
        o.push_str(") ");
    }
    o.trim_end().to_string()
}

pub(super) fn text_block(id: EntryId, m: &EntryMessage, tok: &Tokenizer) -> String {
    let (g, scored) = match m {
        EntryMessage::Rollout(g) => (g, None),
        EntryMessage::Scored(s) => (&s.rollout, Some(s)),
        other => return table_line(id, other) + "\n",
    };
    let rewards = scored.map(|s| &s.rewards);
    let per_sample = |f: fn(&ScoredGroup) -> &Option<Vec<Floats>>, i: usize| {
        scored
            .and_then(|s| f(s).as_ref())
            .and_then(|a| a.get(i))
            .map(|a| a.as_slice())
    };
    let mut o = String::new();
    let prompt = tok
        .decode(&g.prompt_tokens)
        .unwrap_or_else(|e| format!("<{e}>"));
    let _ = writeln!(
        o,
        "== {id} {}  group {}  task {}",
        time_of(id),
        g.group_id,
        g.task
    );
    let _ = writeln!(o, "prompt: {prompt:?}");
    for (i, s) in g.samples.iter().enumerate() {
        let text = tok.decode(&s.tokens).unwrap_or_else(|e| format!("<{e}>"));
        let reward = rewards
            .and_then(|r| r.get(i))
            .map_or(String::new(), |r| format!(" reward {r:.2}"));
        let (token_rewards, teacher) = (
            per_sample(|s| &s.token_rewards, i),
            per_sample(|s| &s.ref_logprobs, i),
        );
        if !s.is_episode() {
            let _ = writeln!(o, "  [{i}]{reward} {:?} {text:?}", s.finish);
            let line = tokens_line(s, 0..s.tokens.len(), tok, token_rewards, teacher);
            let _ = writeln!(o, "      {line}");
            continue;
        }
        // An episode, turn by turn: the model's turns with versions and log-probs and the
        // turn's reward, the environment's answers as text.
        let turns = s.turns();
        let model_turns = turns.iter().filter(|(_, env)| !env).count();
        let _ = writeln!(
            o,
            "  [{i}]{reward} {:?} episode of {model_turns} turns",
            s.finish
        );
        let mut n = 0;
        for (range, env) in turns {
            if env {
                let text = tok
                    .decode(&s.tokens[range.clone()])
                    .unwrap_or_else(|e| format!("<{e}>"));
                let _ = writeln!(o, "      env     {text:?}");
                continue;
            }
            n += 1;
            let turn_reward = s
                .turn_rewards
                .iter()
                .find(|r| range.contains(&(r.index as usize)))
                .map_or(String::new(), |r| format!("  turn reward {:+.3}", r.reward));
            let line = tokens_line(s, range, tok, token_rewards, teacher);
            let _ = writeln!(o, "      turn {n:<2} {line}{turn_reward}");
        }
    }
    o
}

/// A number as a table shows it: a whole number without decimals (`step=3`), others to
/// four places.
pub(super) fn number(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v:.4}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The text view marks each token that carries a reward (`r±…`) and the teacher's
    /// log-prob (`t…`) where a teacher scored it.
    #[test]
    fn text_shows_token_rewards_and_teacher_logprobs() {
        let g = crate::schema::examples::scored_group();
        let tok = Tokenizer::Char(crate::model::tokenizer::CharTokenizer::new(
            "abcdefghijklmn",
        ));
        let text = text_block(EntryId::new(1, 0), &EntryMessage::Scored(g.clone()), &tok);
        let lines: Vec<&str> = text.lines().collect();
        // Sample 0's reward of 1 sits on its last token; sample 1's reward there is 0.
        let first = lines[3];
        assert_eq!(first.matches(" r").count(), 1, "{text}");
        assert!(first.ends_with("r+1.000 t-1.00)"), "{text}");
        assert_eq!(first.matches(" t-").count(), 4, "{text}");
        assert!(!lines[5].contains(" r"), "{text}");
        let plain = text_block(EntryId::new(1, 0), &EntryMessage::Rollout(g.rollout), &tok);
        assert!(!plain.contains(" t-") && !plain.contains(" r+"), "{plain}");
        // An episode: the environment's tokens show as such, the turns' rewards on the
        // turns' last model tokens.
        let e = crate::schema::examples::scored_episode();
        let text = text_block(EntryId::new(1, 0), &EntryMessage::Scored(e.clone()), &tok);
        let sample = &e.rollout.samples[0];
        let turns: Vec<&str> = text
            .lines()
            .skip(3)
            .take_while(|l| !l.starts_with("  ["))
            .collect();
        let model = sample.turns().iter().filter(|(_, env)| !env).count();
        assert_eq!(turns.len(), sample.turns().len(), "{text}");
        assert_eq!(
            turns
                .iter()
                .filter(|l| l.trim_start().starts_with("turn "))
                .count(),
            model,
            "{text}"
        );
        assert_eq!(
            turns
                .iter()
                .filter(|l| l.trim_start().starts_with("env "))
                .count(),
            sample.env.len(),
            "{text}"
        );
        assert!(
            text.contains(&format!("episode of {model} turns")),
            "{text}"
        );
        // Each turn's reward shows on its line: on the token and as the turn's.
        for r in &sample.turn_rewards {
            let line = turns
                .iter()
                .find(|l| l.contains(&format!("turn reward {:+.3}", r.reward)));
            assert!(line.is_some(), "{text}");
        }
        assert!(
            text.contains("r-0.100)") && text.contains("r+1.000)"),
            "{text}"
        );
        assert!(!text.contains("(env)"), "{text}");
    }
}
