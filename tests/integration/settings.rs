//! Every setting, walked from its one definition (`settings!`): it can be set by the file,
//! by the environment and by its flag, with that precedence, on every command that reads its
//! section, and `--help` shows its flag with its doc line and default.

use rlstream::cli::Cli;
use rlstream::config::RunConfig;
use rlstream::settings::{Key, show};

/// Each section with the commands that take its flags.
fn sections() -> Vec<(&'static str, Vec<Key>, &'static [&'static str])> {
    rlstream::config::file_sections()
        .into_iter()
        .map(|s| (s.name, s.keys, s.commands))
        .collect()
}

/// Settings `run` decides itself (consumer names; checkpoints go under `--out`): hidden
/// from its help, and not part of its contract.
fn run_sets_itself(section: &str, key: &str) -> bool {
    key == "name" || (section, key) == ("train", "checkpoint_dir")
}

fn file_text(section: &str, key: &str, v: &toml::Value) -> String {
    let line = format!("{key} = {v}\n");
    if section.is_empty() {
        line
    } else {
        format!("[{section}]\n{line}")
    }
}

fn env_var(section: &str, key: &str) -> String {
    if section.is_empty() {
        format!("RLSTREAM__{}", key.to_uppercase())
    } else {
        format!(
            "RLSTREAM__{}__{}",
            section.to_uppercase(),
            key.to_uppercase()
        )
    }
}

/// The value of `section.key` in the config `command` resolves, as TOML.
fn resolved(
    command: &str,
    file: Option<&std::path::Path>,
    env: &[(String, String)],
    flags: &[String],
    section: &str,
    key: &str,
) -> Option<toml::Value> {
    let mut args = vec!["rlstream".to_string(), command.to_string()];
    if let Some(f) = file {
        args.push("--config".into());
        args.push(f.display().to_string());
    }
    args.extend(flags.iter().cloned());
    let cli = Cli::try_parse_args(&args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
    let cfg = cli
        .command
        .config(env.iter().cloned())
        .expect("a command with settings")
        .unwrap_or_else(|e| panic!("{args:?} {env:?}: {e:#}"));
    let table = toml::Table::try_from(&cfg).expect("config serialises");
    let scope = if section.is_empty() {
        Some(&table)
    } else {
        table.get(section).and_then(toml::Value::as_table)
    };
    scope.and_then(|t| t.get(key)).cloned()
}

#[test]
fn every_setting_is_set_by_file_then_environment_then_flag() {
    let dir = tempfile::tempdir().unwrap();
    let mut checked = 0;
    for (section, keys, commands) in sections() {
        assert!(!keys.is_empty(), "section `{section}` has no keys");
        for key in keys {
            let [v1, v2, v3] = &key.others;
            let path = dir.path().join(format!("{section}-{}.toml", key.name));
            std::fs::write(&path, file_text(section, key.name, v1)).unwrap();
            let env = vec![(env_var(section, key.name), show(v2))];
            let flag = vec![format!("--{}", key.name.replace('_', "-")), show(v3)];
            for &command in commands {
                if command == "run" && run_sets_itself(section, key.name) {
                    continue;
                }
                let at = format!("`{command}`, {section}.{}", key.name);
                assert_eq!(
                    resolved(command, Some(&path), &[], &[], section, key.name).as_ref(),
                    Some(v1),
                    "{at}: the file sets it"
                );
                assert_eq!(
                    resolved(command, Some(&path), &env, &[], section, key.name).as_ref(),
                    Some(v2),
                    "{at}: the environment beats the file"
                );
                assert_eq!(
                    resolved(command, Some(&path), &env, &flag, section, key.name).as_ref(),
                    Some(v3),
                    "{at}: the flag beats the environment"
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 60, "only {checked} settings checked");
}

#[test]
fn help_shows_every_flag_with_its_meaning_and_default() {
    let mut cli = Cli::command_with_defaults();
    let run_defaults = rlstream::commands::run::defaults(RunConfig::default().task);
    let run_table = toml::Table::try_from(&run_defaults).unwrap();
    for (section, keys, commands) in sections() {
        for &command in commands {
            let sub = cli.find_subcommand_mut(command).expect("a command");
            let help = sub.render_long_help().to_string();
            for key in &keys {
                let flag = format!("--{}", key.name.replace('_', "-"));
                if command == "run" && run_sets_itself(section, key.name) {
                    continue;
                }
                let at = format!("`{command} --help`, {flag}");
                assert!(
                    help.contains(&format!("{flag} ")),
                    "{at}: no flag in\n{help}"
                );
                assert!(help.contains(key.doc.trim()), "{at}: no doc line");
                // `run` shows its own defaults where it has them.
                let default = if command == "run" {
                    let scope = if section.is_empty() {
                        Some(&run_table)
                    } else {
                        run_table.get(section).and_then(toml::Value::as_table)
                    };
                    scope.and_then(|t| t.get(key.name)).cloned()
                } else {
                    key.default.clone()
                };
                if let Some(d) = default {
                    let shown = format!("{} [default: {}", key.doc.trim(), show(&d));
                    assert!(help.contains(&shown), "{at}: no `{shown}` in\n{help}");
                }
            }
        }
    }
}

#[test]
fn run_defaults_are_a_layer_under_file_and_flags() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rl.toml");
    std::fs::write(&path, "[train]\nlr = 0.25\n").unwrap();
    let lr = |file: Option<&std::path::Path>, flags: &[String]| {
        resolved("run", file, &[], flags, "train", "lr")
    };
    assert_eq!(
        lr(None, &[]),
        Some(toml::Value::Float(5e-4)),
        "run's own default"
    );
    assert_eq!(lr(Some(&path), &[]), Some(toml::Value::Float(0.25)));
    let flag = ["--lr".to_string(), "0.125".to_string()];
    assert_eq!(lr(Some(&path), &flag), Some(toml::Value::Float(0.125)));
    // The stage's own default is not run's.
    assert_eq!(
        resolved("train", None, &[], &[], "train", "lr"),
        Some(toml::Value::Float(1e-4))
    );
    // The completion length follows the task, whichever layer names the task.
    let task = ["--task".to_string(), "longsort".to_string()];
    let want = i64::from(rlstream::tasks::BuiltinTask::Longsort.max_answer_tokens() + 2);
    assert_eq!(
        resolved("run", None, &[], &task, "gen", "max_new_tokens"),
        Some(toml::Value::Integer(want))
    );
}
