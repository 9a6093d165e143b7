//! Model directories as users name them.

/// A model directory as given on a command line: a directory, or a file that names one
/// beside it (a trainer's `checkpoints/latest`), followed.
pub fn model_dir(path: &std::path::Path) -> std::path::PathBuf {
    if path.is_file()
        && let Ok(name) = std::fs::read_to_string(path)
    {
        let name = name.trim();
        let dir = path
            .parent()
            .unwrap_or(std::path::Path::new("."))
            .join(name);
        if !name.is_empty() && !name.contains('\n') && dir.is_dir() {
            return dir;
        }
    }
    path.to_path_buf()
}
