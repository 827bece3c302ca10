//! The status page's files, embedded in the binary: the page works with
//! no network beyond the admin port itself.

pub struct Asset {
    pub content_type: &'static str,
    pub body: &'static [u8],
}

const INDEX: Asset = Asset {
    content_type: "text/html; charset=utf-8",
    body: include_bytes!("page/index.html"),
};
const SCRIPT: Asset = Asset {
    content_type: "text/javascript; charset=utf-8",
    body: include_bytes!("page/status.js"),
};
const STYLE: Asset = Asset {
    content_type: "text/css; charset=utf-8",
    body: include_bytes!("page/status.css"),
};

/// The file served at `path`, if it is one of the page's. They hold no
/// data (the script fetches `/stats` with the token), so they are served
/// without one.
pub fn asset(path: &str) -> Option<&'static Asset> {
    match path {
        "/" | "/index.html" => Some(&INDEX),
        "/status.js" => Some(&SCRIPT),
        "/status.css" => Some(&STYLE),
        _ => None,
    }
}
