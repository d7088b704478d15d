//! The operator token: where it comes from, and the constant-time check of `Authorization`.

use std::fs::OpenOptions;
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// The environment variable that sets the token.
const TOKEN_ENV: &str = "BRAIN_API_TOKEN";

/// The token file beneath the data directory.
const TOKEN_FILE: &str = "operator.token";

/// Random bytes in a generated token (written as 64 hex digits).
const TOKEN_BYTES: usize = 32;

/// The API token: `BRAIN_API_TOKEN` when it is set and not blank; else the contents of
/// `<data_dir>/operator.token`, which is created (mode 0600, the data directory too if needed)
/// holding 32 random bytes from `/dev/urandom` as hex when it does not exist.
///
/// Fails when the file cannot be read or created, or when it exists but holds no token.
pub fn load_or_create_token(data_dir: &Path) -> std::io::Result<String> {
    if let Some(token) = crate::hardening::var(TOKEN_ENV).and_then(|t| t.into_string().ok()) {
        let token = token.trim();
        if !token.is_empty() {
            return Ok(token.to_owned());
        }
    }
    let path = data_dir.join(TOKEN_FILE);
    match read_token(&path) {
        Ok(token) => return Ok(token),
        Err(error) if error.kind() == ErrorKind::NotFound => {}
        Err(error) => return Err(error),
    }
    std::fs::create_dir_all(data_dir)?;
    let token = random_hex(TOKEN_BYTES)?;
    let created = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path);
    match created {
        Ok(mut file) => {
            file.write_all(format!("{token}\n").as_bytes())?;
            file.sync_all()?;
            log::info!("generated the API token in {}", path.display());
            Ok(token)
        }
        // Another process created it first: use theirs.
        Err(error) if error.kind() == ErrorKind::AlreadyExists => read_token(&path),
        Err(error) => Err(std::io::Error::new(
            error.kind(),
            format!("creating {}: {error}", path.display()),
        )),
    }
}

fn read_token(path: &Path) -> std::io::Result<String> {
    let file = std::fs::File::open(path)?;
    let mode = file.metadata()?.permissions().mode();
    if mode & 0o077 != 0 {
        log::warn!(
            "{} is readable by others (mode {:o}); it should be 0600",
            path.display(),
            mode & 0o777
        );
    }
    let mut text = String::new();
    // A token file is small; refuse to read a huge one into memory.
    file.take(4096).read_to_string(&mut text)?;
    let token = text.trim();
    if token.is_empty() {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            format!("{} holds no token", path.display()),
        ));
    }
    Ok(token.to_owned())
}

fn random_hex(bytes: usize) -> std::io::Result<String> {
    let mut raw = vec![0u8; bytes];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut raw)?;
    Ok(raw.iter().map(|b| format!("{b:02x}")).collect())
}

/// Whether an `Authorization` header value carries `token` as a bearer token. The comparison
/// takes the same time wherever the first difference is.
pub(crate) fn authorized(header: Option<&str>, token: &str) -> bool {
    let Some(value) = header else {
        return false;
    };
    let value = value.trim();
    let Some((scheme, credentials)) = value.split_once(' ') else {
        return false;
    };
    scheme.eq_ignore_ascii_case("bearer") && constant_time_eq(credentials.trim(), token)
}

/// Compares two strings in time that depends only on their lengths.
fn constant_time_eq(given: &str, expected: &str) -> bool {
    let given = given.as_bytes();
    let expected = expected.as_bytes();
    let mut difference = u8::from(given.len() != expected.len());
    for (index, byte) in expected.iter().enumerate() {
        // Compare against something of the same length even when the lengths differ.
        let other = given.get(index).copied().unwrap_or(!*byte);
        difference |= byte ^ other;
    }
    difference == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens_are_compared_exactly() {
        assert!(authorized(Some("Bearer abc"), "abc"));
        assert!(authorized(Some("bearer  abc "), "abc"));
        assert!(!authorized(Some("Bearer abd"), "abc"));
        assert!(!authorized(Some("Bearer ab"), "abc"));
        assert!(!authorized(Some("Bearer abcd"), "abc"));
        assert!(!authorized(Some("Bearer "), "abc"));
        assert!(!authorized(Some("Basic abc"), "abc"));
        assert!(!authorized(Some("abc"), "abc"));
        assert!(!authorized(None, "abc"));
    }

    #[test]
    fn a_token_file_is_created_once_with_mode_0600() {
        let dir = std::env::temp_dir().join(format!("brain-token-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // The environment may carry BRAIN_API_TOKEN; this test reads the file directly.
        let path = dir.join(TOKEN_FILE);
        std::fs::create_dir_all(&dir).unwrap();
        assert!(read_token(&path).is_err());
        let first = random_hex(TOKEN_BYTES).unwrap();
        assert_eq!(first.len(), 64);
        assert!(first.bytes().all(|b| b.is_ascii_hexdigit()));
        if std::env::var(TOKEN_ENV).is_err() {
            let token = load_or_create_token(&dir).unwrap();
            assert_eq!(token.len(), 64);
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
            assert_eq!(load_or_create_token(&dir).unwrap(), token);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
