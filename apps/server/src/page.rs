//! The chat page at `/`: one static HTML file (with its script and style inline) compiled into the binary. It
//! talks to the same `/v1` API as any client, so it needs no build step and fetches nothing from the network.

use axum::http::header;
use axum::response::{IntoResponse, Response};

/// The page (`chat.html` beside this file).
pub const CHAT_HTML: &str = include_str!("chat.html");

/// `GET /`.
pub async fn chat_page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            // The page loads nothing from elsewhere; say so to the browser too.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'",
            ),
        ],
        CHAT_HTML,
    )
        .into_response()
}
